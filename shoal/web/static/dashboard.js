"use strict";
// The shoal dashboard: polls the JSON endpoints and draws them. Every string from the server
// (node names, task and metric names, refusal details) goes in with textContent, never as HTML.
(function () {
  const POLL_MS = 2000;
  const COLORS = ["#1f6feb", "#cf222e", "#1a7f37", "#bf8700", "#8250df", "#0a7ea4", "#d1242f", "#6e7781"];
  const state = { selected: null, charts: new Map(), kind: "server", busy: false };

  // For scripts and tests: the points a chart draws, as [[x, y], ...] (nulls left out).
  window.shoal = {
    charts: state.charts,
    points(key, series) {
      const c = state.charts.get(key);
      if (!c) return null;
      const xs = c.plot.data[0], ys = c.plot.data[series || 1];
      const out = [];
      for (let i = 0; i < xs.length; i++) if (ys[i] !== null && ys[i] !== undefined) out.push([xs[i], ys[i]]);
      return out;
    },
  };

  function $(id) { return document.getElementById(id); }

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }

  async function getJSON(path) {
    const r = await fetch(path, { credentials: "same-origin", cache: "no-store", headers: { Accept: "application/json" } });
    if (r.status === 401) { window.location.assign("/login"); throw new Error("logged out"); }
    if (!r.ok) throw new Error(path + " answered " + r.status);
    return r.json();
  }

  function fmtNum(v) {
    if (v === null || v === undefined) return "–";
    if (typeof v !== "number") return String(v);
    if (Number.isInteger(v)) return v.toLocaleString("en");
    const a = Math.abs(v);
    return a !== 0 && (a < 1e-3 || a >= 1e6) ? v.toExponential(3) : v.toPrecision(4);
  }

  function fmtBytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "kB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }

  function fmtSeconds(s) {
    if (s === null || s === undefined) return "–";
    if (s < 60) return s.toFixed(0) + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
    return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  }

  // [1, 2, 3, 7, 9, 10] -> "1–3, 7, 9–10"
  function ranges(xs) {
    const out = [];
    for (let i = 0; i < xs.length; i++) {
      let j = i;
      while (j + 1 < xs.length && xs[j + 1] === xs[j] + 1) j++;
      out.push(j > i ? xs[i] + "–" + xs[j] : String(xs[i]));
      i = j;
    }
    return out.join(", ") || "–";
  }

  function badge(text, cls) { return el("span", text, "badge " + (cls || text)); }

  function cell(row, content, cls) {
    const td = el("td", null, cls);
    if (content instanceof Node) td.appendChild(content); else td.textContent = content === undefined ? "" : String(content);
    row.appendChild(td);
    return td;
  }

  // --- runs -------------------------------------------------------------------------------------

  function renderRuns(runs) {
    const body = $("runs").tBodies[0];
    body.replaceChildren();
    for (const r of runs) {
      const tr = el("tr");
      tr.dataset.run = r.run;
      if (r.run === state.selected) tr.classList.add("selected");
      cell(tr, r.run);
      cell(tr, r.task);
      cell(tr, badge(r.status));
      cell(tr, r.mode || "–");
      cell(tr, r.round === undefined ? "–" : r.round + (r.rounds_target ? " / " + r.rounds_target : ""), "num");
      cell(tr, r.version === undefined ? "–" : r.version, "num");
      cell(tr, fmtSeconds(r.elapsed_s), "num");
      cell(tr, r.reason || "");
      tr.addEventListener("click", () => { selectRun(r.run); });
      body.appendChild(tr);
    }
    if (state.selected === null && runs.length) {
      const live = runs.find((r) => r.status === "running") || runs[runs.length - 1];
      selectRun(live.run, true);
    }
  }

  function selectRun(run, quiet) {
    if (run === state.selected) return;
    state.selected = run;
    for (const c of state.charts.values()) c.plot.destroy();
    state.charts.clear();
    $("charts").replaceChildren();
    $("charts-ops").replaceChildren();
    for (const tr of $("runs").tBodies[0].rows) tr.classList.toggle("selected", tr.dataset.run === run);
    if (!quiet) refresh();
  }

  // --- charts -----------------------------------------------------------------------------------

  // Series of points [[x, y], ...] on one shared x: [xs, ys1, ys2, ...] with null where one has no point.
  function align(seriesPoints) {
    const xs = new Set();
    for (const pts of seriesPoints) for (const p of pts) xs.add(p[0]);
    const sorted = Array.from(xs).sort((a, b) => a - b);
    const index = new Map(sorted.map((x, i) => [x, i]));
    const out = [sorted];
    for (const pts of seriesPoints) {
      const ys = new Array(sorted.length).fill(null);
      for (const p of pts) ys[index.get(p[0])] = p[1];
      out.push(ys);
    }
    return out;
  }

  function chartWidth(box) { return Math.max(280, box.clientWidth - 12); }

  function drawChart(containerId, key, title, xLabel, labels, seriesPoints, yFormat) {
    const data = align(seriesPoints);
    let c = state.charts.get(key);
    if (!c) {
      const box = el("div", null, "chart");
      box.dataset.chart = key;
      box.appendChild(el("div", title, "title"));
      $(containerId).appendChild(box);
      const opts = {
        width: chartWidth(box),
        height: 210,
        scales: { x: { time: false } },
        axes: [
          { label: xLabel, size: 40 },
          { size: yFormat ? 78 : 64, values: (u, vals) => vals.map(yFormat || fmtNum) },
        ],
        series: [{ label: xLabel }].concat(labels.map((label, i) => ({
          label: label, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true,
          points: { show: true, size: 5 }, value: (u, v) => (v === null ? "–" : (yFormat || fmtNum)(v)),
        }))),
      };
      c = { box: box, plot: new uPlot(opts, data, box) };
      state.charts.set(key, c);
    } else {
      c.plot.setData(data);
    }
  }

  window.addEventListener("resize", () => {
    for (const c of state.charts.values()) c.plot.setSize({ width: chartWidth(c.box), height: 210 });
  });

  function renderRun(run) {
    $("run").hidden = false;
    $("run-name").textContent = run.run;
    $("run-status").replaceChildren(badge(run.status));
    $("run-round").textContent = run.round === undefined ? "–" : String(run.round);
    $("run-version").textContent = run.version === undefined ? "–" : String(run.version);
    const eps = run.epsilon && run.epsilon.points.length ? run.epsilon.points[run.epsilon.points.length - 1][1] : null;
    const kept = run.epsilon && run.epsilon.mode === "local" ? "local DP: each node keeps its epsilon" : "no DP";
    const srv = run.epsilon && run.epsilon.server && run.epsilon.server.length ? run.epsilon.server[run.epsilon.server.length - 1][1] : null;
    $("run-epsilon").textContent = (eps === null ? kept : fmtNum(eps) + " / " + (run.epsilon.target === null ? "no target" : fmtNum(run.epsilon.target)))
      + (srv === null ? "" : " (against the server: " + fmtNum(srv) + ")");
    const t = run.traffic || {};
    if (t.live) {
      $("run-bytes").textContent = fmtBytes(t.bytes_up) + " / " + fmtBytes(t.bytes_down);
      const refused = Object.values(t.refused).reduce((a, b) => a + b, 0);
      $("run-uploads").textContent = fmtNum(t.accepted) + " / " + fmtNum(refused);
      $("run-late").textContent = fmtNum(t.stragglers) + " / " + fmtNum(t.dropouts);
    }
    const xLabel = run.x || "version";
    for (const [name, points] of Object.entries(run.metrics)) {
      drawChart("charts", "metric:" + name, name, xLabel, [name], [points]);
    }
    if (!Object.keys(run.metrics).length && !$("charts").childElementCount) {
      $("charts").appendChild(el("div", "no metrics yet: the first evaluated version adds them", "muted"));
    } else {
      for (const d of $("charts").querySelectorAll(".muted")) d.remove();
    }
    if (run.epsilon.points.length) {
      const target = run.epsilon.target;
      const pts = [run.epsilon.points];
      if (target !== null) pts.push(run.epsilon.points.map((p) => [p[0], target]));
      drawChart("charts-ops", "epsilon", "epsilon spent (and target)", xLabel, target !== null ? ["epsilon", "target"] : ["epsilon"], pts);
    }
    if (t.live && t.history.length) {
      const h = t.history;
      drawChart("charts-ops", "bytes", "bytes up and down (total)", "version", ["up", "down"],
        [h.map((r) => [r.version, r.bytes_up]), h.map((r) => [r.version, r.bytes_down])], fmtBytes);
      drawChart("charts-ops", "uploads", "uploads accepted and refused (total)", "version", ["accepted", "refused", "stragglers", "dropouts"],
        [h.map((r) => [r.version, r.accepted]), h.map((r) => [r.version, r.refused]),
          h.map((r) => [r.version, r.stragglers]), h.map((r) => [r.version, r.dropouts])]);
    }
    const part = run.participation || {};
    if (part.num_results && part.num_results.length) {
      drawChart("charts-ops", "participation", "results per version (and late ones)", xLabel, ["results", "late"],
        [part.num_results, part.num_late]);
    }
    const body = $("refusals").tBodies[0];
    body.replaceChildren();
    const refused = t.live ? Object.entries(t.refused) : [];
    if (!refused.length) {
      const tr = el("tr");
      cell(tr, t.live ? "none" : "(counted only while the run is live)", "muted");
      cell(tr, "");
      body.appendChild(tr);
    }
    for (const [code, n] of refused) {
      const tr = el("tr");
      cell(tr, code, "refusal-code");
      cell(tr, fmtNum(n), "num");
      body.appendChild(tr);
    }
  }

  // --- nodes ------------------------------------------------------------------------------------

  function renderNodes(nodes) {
    const body = $("nodes").tBodies[0];
    body.replaceChildren();
    for (const n of nodes) {
      const tr = el("tr");
      tr.dataset.node = n.name;
      cell(tr, n.name, "node-name");
      cell(tr, n.online ? badge("online") : badge("offline", "offline"));
      const never = state.kind === "peer" ? "–" : "never";  // a peer does not time its neighbours
      cell(tr, n.last_seen_ago_s === null || n.last_seen_ago_s === undefined ? never : fmtSeconds(n.last_seen_ago_s) + " ago", "num");
      const runs = Object.entries(n.runs || {});
      cell(tr, runs.length ? runs.map(([run, r]) => run + ": " + r.accepted + " uploads, last rounds " + ranges(r.rounds)).join("; ") : "–");
      const lr = n.last_refusal;
      const when = [lr && lr.ago_s !== null ? fmtSeconds(lr.ago_s) + " ago" : "", lr && lr.run ? lr.run : ""].filter(Boolean).join(", ");
      cell(tr, lr ? lr.code + ": " + lr.detail + (when ? " (" + when + ")" : "") : "–");
      cell(tr, n.revoked ? badge("revoked") : "no");
      body.appendChild(tr);
    }
  }

  // --- the loop ---------------------------------------------------------------------------------

  async function refresh() {
    if (state.busy) return;
    state.busy = true;
    try {
      const runs = await getJSON("/v1/dashboard/runs");
      if (runs.kind !== state.kind) {
        state.kind = runs.kind;
        $("kind").textContent = runs.kind === "peer" ? "peer" : "server";
        $("nodes-title").textContent = runs.kind === "peer" ? "Neighbours and directory" : "Nodes";
      }
      renderRuns(runs.runs);
      if (state.selected !== null) renderRun(await getJSON("/v1/dashboard/runs/" + encodeURIComponent(state.selected)));
      renderNodes((await getJSON("/v1/dashboard/nodes")).nodes);
      $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    } catch (e) {
      $("updated").textContent = "update failed: " + e.message;
    } finally {
      state.busy = false;
    }
  }

  async function loop() {
    await refresh();
    window.setTimeout(loop, POLL_MS);
  }

  loop();
})();
