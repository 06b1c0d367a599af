"""The server's page in a real headless Chromium: `shoal server` and three `shoal client`
processes on 127.0.0.1 over HTTPS, one node registered under a hostile name.

The browser (Debian's chromium, driven by selenium through chromium-driver) is sent to the
login form, logs in, watches the version counter advance without a reload, reads the points
of a curve and finds them equal to metrics.jsonl, and finds the hostile node name shown as
text with no script run. ``SHOAL_SCREENSHOT=PATH`` also saves the screenshot there (how
docs/img/dashboard.png is made). Without the browser the test skips, except on CI (CI=true),
where .ci/run installs it and a missing browser is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from shoal.metrics import read_jsonl
from shoal.pki import write_secret
from shoal.server.registry import Registry, hash_token
from shoal.tls import make_private_ca
from shoal.web.dashboard import CSP

from ..server.test_deploy import deployment

HOSTILE = "<img src=x onerror=alert(1)>"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")

if not (CHROMIUM and DRIVER):
    if os.environ.get("CI") == "true":
        raise RuntimeError("CI=true but chromium / chromedriver are missing: .ci/run installs them with apt-get")
    pytest.skip("no chromium + chromedriver (apt-get install chromium chromium-driver)", allow_module_level=True)

if os.environ.get("CI") == "true":  # in the dev extra: on CI its absence is a failure, not a skip
    from selenium import webdriver
else:
    webdriver = pytest.importorskip("selenium.webdriver")


def _browser(tmp: Path):
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1350",
        "--ignore-certificate-errors",  # the test's private CA is not in the browser's store
        f"--user-data-dir={tmp / 'chromium-profile'}",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(DRIVER, log_output=str(tmp / "chromedriver.log")), options=opts)


def _get(url: str, ctx: ssl.SSLContext, headers: dict | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=ctx), _NoRedirect())
    try:
        with opener.open(req, timeout=5) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def _until(pred, timeout: float, what: str, dump=lambda: ""):
    from selenium.common.exceptions import StaleElementReferenceException

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            got = pred()
        except StaleElementReferenceException:  # the page redrew what we held (it polls): look again
            got = None
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout} s\n{dump()}")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dashboard_in_a_real_browser(tmp_path):
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By

    # rounds: more than the test lasts on any machine (it ends by killing the processes), so the
    # counter is still moving whenever the page looks, however fast the rounds are
    with deployment(tmp_path, n=3, rounds=100_000, deadline=20.0) as d:
        # The third node's token is registered under a hostile name (as a registry written by other
        # tooling could hold it): every place the page shows it must show text.
        hostile_token = "h" * 43
        reg = Registry(d.cfg.server.db)
        reg.db.execute(
            "INSERT INTO nodes (name, token_hash, created) VALUES (?, ?, ?)", (HOSTILE, hash_token(hostile_token), 0.0)
        )
        reg.close()
        (tmp_path / f"{d.shards[2].stem}.token").unlink()
        write_secret(tmp_path / f"{d.shards[2].stem}.token", hostile_token.encode())

        pki = make_private_ca(tmp_path / "pki")
        d.url = d.url.replace("http://", "https://")
        tls = ["--set", f"server.tls_cert={json.dumps(str(pki.cert))}"]
        tls += ["--set", f"server.tls_key={json.dumps(str(pki.key))}"]
        d.server(*tls, "--set", "server.eval=true")
        ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
        _until(lambda: _up(d.url, ctx), 60, "the server is up", d.dump)

        # Without a login: the page redirects to the form, the JSON answers 401; the CSP is sent.
        status, headers, _ = _get(d.url + "/", ctx)
        assert status == 303 and headers["Location"] == "/login" and headers["Content-Security-Policy"] == CSP
        for path in ("/v1/dashboard/runs", "/v1/dashboard/runs/run", "/v1/dashboard/nodes"):
            status, headers, _ = _get(d.url + path, ctx)
            assert status == 401 and headers["Content-Security-Policy"] == CSP, path

        browser = _browser(tmp_path)
        try:
            browser.set_page_load_timeout(30)
            browser.get(d.url + "/")
            assert browser.current_url.endswith("/login")
            browser.find_element(By.ID, "token").send_keys(d.admin)
            browser.find_element(By.CSS_SELECTOR, "form button").click()
            page = lambda: browser.current_url + "\n" + browser.page_source[:2000]  # noqa: E731
            _until(lambda: browser.current_url.rstrip("/") == d.url, 20, "logged in", page)
            assert d.admin not in browser.current_url  # the token never travels in a URL
            cookies = {c["name"]: c for c in browser.get_cookies()}
            session = cookies["__Host-shoal-session"]
            assert session["httpOnly"] and session["secure"] and session["sameSite"] == "Strict"
            assert browser.execute_script("return document.cookie") == ""  # HttpOnly: no script can read it
            _until(lambda: browser.find_element(By.ID, "run-version").text == "0", 20, "the run shows version 0")
            browser.execute_script("window.__sameDocument = true")  # gone if the page were reloaded

            clients = [d.client(i, "--ca-cert", str(pki.ca_cert)) for i in range(3)]

            def version() -> int:
                text = browser.find_element(By.ID, "run-version").text
                return int(text) if text.isdigit() else -1

            first = _until(lambda: version() if version() >= 1 else 0, 90, "the version counter advances", d.dump)
            _until(lambda: version() > first, 90, "the version counter advances again", d.dump)
            assert browser.execute_script("return window.__sameDocument === true"), "the page was reloaded"

            # One curve's points, read from the chart itself, are metrics.jsonl's (up to the last drawn).
            points = _until(
                lambda: browser.execute_script("return window.shoal.points('metric:test_accuracy')"),
                30,
                "the test_accuracy chart",
            )
            records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
            upto = points[-1][0]
            expected = [[r["version"], r["test_accuracy"]] for r in records if r["version"] <= upto]
            assert len(points) >= 2 and points == expected

            # The hostile node: its name is text in the nodes table, no element made of it, no script ran.
            # (the table is redrawn with every poll: each look finds the row afresh)
            def hostile_row():
                rows = [r for r in browser.find_elements(By.CSS_SELECTOR, "#nodes tbody tr") if HOSTILE in r.text]
                return rows[0] if rows else None

            name = _until(
                lambda: (r := hostile_row()) is not None and r.find_element(By.CSS_SELECTOR, ".node-name").text,
                30,
                "the hostile node's row",
            )
            assert name == HOSTILE
            assert browser.execute_script("return document.querySelectorAll('#nodes img, main img').length") == 0
            _until(lambda: (r := hostile_row()) is not None and "online" in r.text, 30, "the hostile node online")
            with pytest.raises(NoAlertPresentException):
                browser.switch_to.alert.text  # noqa: B018  (an alert(1) that ran would be open here)
            errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
            assert not errors, errors

            browser.execute_script("window.scrollTo(0, 0)")
            shot = tmp_path / "dashboard.png"
            assert browser.save_screenshot(str(shot))
            if os.environ.get("SHOAL_SCREENSHOT"):
                shutil.copyfile(shot, os.environ["SHOAL_SCREENSHOT"])
        finally:
            browser.quit()
        for c in clients:
            c.kill()


def _up(url: str, ctx: ssl.SSLContext) -> bool:
    try:
        _get(url + "/login", ctx)
        return True
    except OSError:
        return False
