"""The sans-I/O peer (p2p/service.py) against every hostile probe we know of, without a
network: each probe is refused with a 4xx (or bounded), the model stays finite and within
the merge bound, nothing but ``rejected`` moves, and an honest merge still goes through."""

from __future__ import annotations

import itertools
import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.config import Config, load_config
from shoal.errors import Malformed
from shoal.models import build_model
from shoal.p2p.addresses import AddressPolicy, check_url, kind_of
from shoal.p2p.gossip import MAX_COUNT
from shoal.p2p.group_average import SliceMessage, group_id
from shoal.p2p.model_wire import encode_gossip_model, encode_slice
from shoal.p2p.secure_group import SecureMessage
from shoal.p2p.service import MAX_HELD, PeerService, Rejected
from shoal.params import ParamSpec
from shoal.wire import encode

ME = "https://127.0.0.1:9000"
HONEST = "https://127.0.0.1:9001"
LONG_LABEL = "https://" + "a" * 64 + ".example.org:9000"


def _service(cfg: Config | None = None, me: str = ME, insecure: bool = False) -> PeerService:
    cfg = cfg or Config()
    torch.manual_seed(0)
    spec = ParamSpec.of(build_model("logreg", (20,), 4))
    params = 0.1 * torch.randn(spec.numel, generator=torch.Generator().manual_seed(0))
    svc = PeerService(cfg, spec, params, 30, me, (HONEST,), insecure)
    svc.node.local_update(params + 0.01)  # one local step: it sets the merge radius's floor
    return svc


_SEQ = itertools.count(1)  # message counters (microseconds): fresh at the tests' clock of 0..30 s


def _model(svc: PeerService, params: torch.Tensor, **header) -> bytes:
    extra = {"age": 3, "num_examples": 10, "sender": HONEST, "seq": next(_SEQ), **header}
    return encode_gossip_model(params, svc.spec, 1, extra)


def _sh(body: dict) -> bytes:
    """A shuffle body, with a fresh message counter unless it names one."""
    return json.dumps({**body, "seq": body.get("seq", next(_SEQ))}).encode()


def _raw_model(svc: PeerService, params: torch.Tensor, header: dict) -> bytes:
    """A model body with any header fields (types shoal would never write)."""
    full = {"kind": "model", "spec_hash": svc.spec.hash, "version": 1, "seq": next(_SEQ), **header}
    return encode({"params": params}, full)


def _state(svc: PeerService) -> tuple:
    n = svc.node
    return (n.params.clone(), n.age, n.version, n.merges, sorted(n.membership.known), sorted(n.membership.view))


def _unchanged(svc: PeerService, before: tuple) -> None:
    after = _state(svc)
    assert torch.equal(after[0], before[0]) and after[1:] == before[1:]


def _honest_merge_goes_on(svc: PeerService) -> None:
    merges = svc.node.merges
    near = svc.node.params + 0.001
    svc.on_gossip(_model(svc, near, age=svc.node.age + 1), 1.0)
    assert svc.node.merges == merges + 1
    assert torch.isfinite(svc.node.params).all()


def _refused(svc: PeerService, call, status: int | None = None, code: str | None = None) -> Rejected:
    before = _state(svc)
    with pytest.raises(Rejected) as e:
        call()
    assert 400 <= e.value.status < 500
    if status is not None:
        assert e.value.status == status, e.value.detail
    if code is not None:
        assert e.value.code == code, e.value.detail
    _unchanged(svc, before)
    return e.value


def test_urls_are_checked_by_one_function():
    assert check_url("https://127.0.0.1:9000") == "https://127.0.0.1:9000"
    assert check_url("https://Peer-1.Example.org:8443/") == "https://peer-1.example.org:8443"
    assert check_url("https://[::1]:9000") == "https://[::1]:9000"
    assert check_url("https://bücher.example:9000") == "https://xn--bcher-kva.example:9000"
    assert check_url("http://10.0.0.1:9000", insecure=True) == "http://10.0.0.1:9000"
    for bad in (
        LONG_LABEL,
        "https://user:pass@127.0.0.1:9000",
        "http://127.0.0.1:9000",
        "https://127.0.0.1:70000",
        "https://127.0.0.1:0",
        "https://[zz::1]:9000",
        "https://a..b:9000",
        "https://-a.b:9000",
        "https://127.0.0.1:9000/x?y",
        "ftp://127.0.0.1:9000",
        "https://" + "a" * 300,
        "https://1.2.3:9000",
        "https://" + "é" * 70 + ".org:9000",
        "https://a b:9000",
        7,
        None,
        "",
    ):
        with pytest.raises(Malformed):
            check_url(bad)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=120))
def test_any_text_is_a_url_or_malformed(text):
    for candidate in (text, "https://" + text, "https://" + text + ":9000"):
        try:
            out = check_url(candidate)
        except Malformed:
            continue
        assert check_url(out) == out  # canonical forms are fixed points


def test_address_policy_contacts_only_our_kinds_and_limits_new_contacts():
    policy = AddressPolicy([ME, HONEST], interval=1.0, burst=2)
    for forbidden in (
        "https://169.254.169.254:80",
        "https://192.0.2.1:9000",
        "https://[2001:db8::1]:9000",
        "https://attacker.invalid:9000",
        "https://[fe80::1]:9000",
        "https://0.0.0.0:9000",
    ):
        assert kind_of(forbidden) == "forbidden" or not policy.allowed(forbidden)
        assert not policy.may_contact(forbidden, 0.0)
    assert policy.allowed("https://[::1]:9000") and policy.allowed("https://localhost:9000")
    assert not policy.allowed("https://8.8.8.8:9000")  # a global address: not a kind of ours (loopback)
    assert not policy.allowed("https://peer.example.org:9000")  # a name: neither
    assert policy.may_contact(HONEST, 0.0)  # bootstrap: verified
    news = [f"https://127.0.0.{i}:9000" for i in range(2, 8)]
    assert [policy.may_contact(u, 0.0) for u in news] == [True, True, False, False, False, False]
    assert policy.may_contact(news[2], 1.0)  # one more per interval
    # what a name resolves to: never a forbidden address (unless allowed)
    assert policy.resolved_ok("10.1.2.3") and policy.resolved_ok("::1")
    assert not policy.resolved_ok("169.254.169.254") and not policy.resolved_ok("fe80::1")
    assert AddressPolicy([ME], allow_networks=["169.254.0.0/16"]).resolved_ok("169.254.1.1")
    wide = AddressPolicy([ME], allow_networks=["8.8.8.0/24"])
    assert wide.allowed("https://8.8.8.8:9000") and not wide.allowed("https://8.8.4.4:9000")


def test_a_long_host_label_or_userinfo_is_refused_wherever_it_comes():
    svc = _service()
    good = svc.node.params + 0.001
    _refused(svc, lambda: svc.on_gossip(_model(svc, good, sender=LONG_LABEL), 0.0), 400)
    _refused(svc, lambda: svc.on_gossip(_model(svc, good, sender="https://u:p@127.0.0.1:1"), 0.0), 400)
    shuffle = {"sender": HONEST, "entries": [[LONG_LABEL, 0]]}
    _refused(svc, lambda: svc.on_shuffle(_sh(shuffle), 0.0), 400)
    shuffle = {"sender": HONEST, "entries": [["https://u:p@127.0.0.1:1", 0]]}
    _refused(svc, lambda: svc.on_shuffle(_sh(shuffle), 0.0), 400)
    # the same in an answer to our own shuffle: a failure of that peer, nothing learned
    out = svc.start_shuffle(0.0)
    assert out is not None
    known = set(svc.node.membership.known)
    svc.on_shuffle_reply(HONEST, _sh({"sender": HONEST, "entries": [[LONG_LABEL, 0]]}), 0.1)
    assert set(svc.node.membership.known) <= known
    _honest_merge_goes_on(svc)


@pytest.mark.parametrize("far", [0.0, 4.0])
def test_huge_models_are_refused_and_far_ones_clipped(far):
    """Beyond max_abs: refused. Beyond the radius: clipped; with gossip.merge_far = 4 (the
    default) a model from a lone sender more than 4 radii away, and 4 times as far as our model
    has come from its start, is refused instead (0 clips however far)."""
    cfg = Config()
    cfg.gossip.merge_far = far
    svc = _service(cfg)
    big = torch.finfo(torch.float32).max
    for value in (big, 1e30, 2e4):
        e = _refused(svc, lambda v=value: svc.on_gossip(_model(svc, torch.full_like(svc.node.params, v)), 0.0), 400)
        assert e.code == "out_of_range"
    own = svc.node.params.clone()
    bound = svc.node.merge_bound
    limit = bound.limit(own)
    refused, clipped = bound.refused, bound.clipped
    svc.on_gossip(_model(svc, torch.full_like(own, 9e3), age=10**6), 0.0)  # within max_abs, far beyond the radius
    if far:
        assert bound.refused == refused + 1 and svc.node.bounded == 1 and torch.equal(svc.node.params, own)
    else:
        assert bound.clipped == clipped + 1 and svc.node.bounded == 1
        assert float(torch.linalg.vector_norm(svc.node.params - own)) <= limit * (1 + 1e-5)
        own = svc.node.params.clone()
        limit = bound.limit(own)
    direction = torch.ones_like(own) / own.numel() ** 0.5
    svc.on_gossip(_model(svc, own + 2 * limit * direction, age=10**6), 0.0)  # beyond the radius, within 4x: clipped
    assert bound.clipped == clipped + (1 if far else 2) and svc.node.bounded == 2
    assert float(torch.linalg.vector_norm(svc.node.params - own)) <= limit * (1 + 1e-5)
    assert torch.isfinite(svc.node.params).all()
    _honest_merge_goes_on(svc)


def test_ages_and_counts_are_bounded_and_cannot_overflow():
    svc = _service()
    good = svc.node.params + 0.001
    for age in (9999999999999999999, MAX_COUNT + 1, -1, True, 1.5, "3", None):
        _refused(
            svc, lambda a=age: svc.on_gossip(_raw_model(svc, good, {"age": a, "num_examples": 1, "sender": HONEST}), 0)
        )
    for n in (0, True, 10**19):
        _refused(
            svc, lambda n=n: svc.on_gossip(_raw_model(svc, good, {"age": 1, "num_examples": n, "sender": HONEST}), 0)
        )
    _refused(svc, lambda: svc.on_shuffle(_sh({"sender": HONEST, "entries": [[HONEST, True]]}), 0))
    svc.on_gossip(_model(svc, good, age=MAX_COUNT), 0.0)  # the largest age a peer takes ...
    assert svc.node.age == MAX_COUNT
    svc.node.local_update(svc.node.params)  # ... and one more local step does not pass it
    assert svc.node.age == MAX_COUNT
    answer = svc.on_gossip(_model(svc, good, age=MAX_COUNT), 1.0)  # our answer is still a valid message
    other = _service(me=HONEST)
    other.on_exchange_reply(ME, answer, 1.0)
    assert other.node.age == MAX_COUNT


def test_hostile_json_gets_400_not_a_crash():
    svc = _service()
    deep = b"[" * 5000 + b"]" * 5000
    digits = b'{"sender": "' + HONEST.encode() + b'", "entries": [["' + HONEST.encode() + b'", ' + b"9" * 5000 + b"]]}"
    for body in (deep, digits, b"\xff\xfe", b'{"sender": 1, "sender": 2, "entries": []}', b"NaN", b"{}" * 40000):
        _refused(svc, lambda b=body: svc.on_shuffle(b, 0.0), None)
    # the same in a model's safetensors header (read for its spec hash before anything else)
    for meta in (deep, b"9" * 5000):
        body = struct.pack("<Q", len(meta)) + meta
        _refused(svc, lambda b=body: svc.on_gossip(b, 0.0), 400)
    _honest_merge_goes_on(svc)


def _slice(svc: PeerService, sender: str, round_: int, members: tuple[str, ...], data: torch.Tensor) -> bytes:
    idx = members.index(svc.id) if svc.id in members else 0
    return encode_slice(
        SliceMessage(sender, svc.id, round_, group_id(round_, members), members, idx, "part", 1.0, data), svc.spec
    )


def test_group_and_secure_messages_are_held_only_for_open_rounds_with_a_cap():
    plain = _service()  # runs push-pull gossip: takes no group message at all
    members = (HONEST, ME)
    body = _slice(plain, HONEST, 10, members, torch.zeros(plain.spec.numel // 2))
    e = _refused(plain, lambda: plain.on_group(body, 0.0, 10), 409)
    assert e.code == "not_running" and plain.held == {}
    secure = SecureMessage(HONEST, ME, 10, "g", members, "abort", None)
    from shoal.p2p.model_wire import encode_secure

    e = _refused(plain, lambda: plain.on_secure(encode_secure(secure, plain.spec), 0.0, 10), 409)
    assert e.code == "not_running" and plain.held == {}

    svc = _service(load_config(None, ['gossip.algorithm="group_average"']))
    n = svc.spec.numel
    part = torch.zeros(n - n // 2)
    held = 0
    for i in range(300):  # model-sized slices from many claimed senders for a round about to open
        sender = f"https://127.0.0.{2 + i % 200}:{9000 + i}"
        try:
            out = svc.on_group(_slice(svc, sender, 11, (ME, sender), part), 0.0, 10)
            held += out[0] is None
        except Rejected as e:
            assert e.status == 503 and e.code == "busy"
    assert held == MAX_HELD == sum(map(len, svc.held.values()))
    assert len(svc.node.membership.known) == 1  # held messages teach the directory nothing
    for r in (9, 10 + 2 * svc.g.exchanges_per_round, 10**12):  # closed, too far ahead, absurd
        _refused(svc, lambda r=r: svc.on_group(_slice(svc, HONEST, r, members, part), 0.0, 10), 409)
    _refused(svc, lambda: svc.on_group(_slice(svc, HONEST, 10, (HONEST, "https://127.0.0.5:1"), part), 0.0, 10))
    svc.open_group(12, 1.0, 0.0, 1.0)  # a later round opens: the held ones of round 11 expire
    svc.on_group(_slice(svc, HONEST, 13, members, part), 0.0, 12)
    assert sum(map(len, svc.held.values())) == 1


def test_a_model_for_a_peer_that_runs_another_algorithm_or_itself_is_refused():
    svc = _service(load_config(None, ['gossip.algorithm="dpsgd"']))
    good = svc.node.params + 0.001
    _refused(svc, lambda: svc.on_gossip(_model(svc, good), 0.0), 409)
    body = encode_gossip_model(good, svc.spec, 1, {"age": 1, "num_examples": 1, "sender": ME, "step": 10, "seq": 1})
    _refused(svc, lambda: svc.parse_mix_request(body, 10), 400)  # from ourselves
    body = encode_gossip_model(
        good, svc.spec, 1, {"age": 1, "num_examples": 1, "sender": HONEST, "step": 10**6, "seq": 1}
    )
    _refused(svc, lambda: svc.parse_mix_request(body, 10), 409)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=80),
        lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=10), inner, max_size=6),
        max_leaves=30,
    )
)
def test_any_json_shuffle_is_taken_or_refused_with_a_4xx(value):
    svc = _service()
    for body in (json.dumps(value).encode(), _sh({"sender": HONEST, "entries": value})):
        before = _state(svc)
        try:
            svc.on_shuffle(body, 0.0)
        except Rejected as e:
            assert 400 <= e.status < 500
            _unchanged(svc, before)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.sampled_from(["age", "num_examples", "sender", "version", "kind", "spec_hash", "zstd", "encoding"]),
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=300),
        max_size=8,
    ),
    st.sampled_from([0.0, 1e-3, 1.0, 1e3, 1e5, float("inf"), float("nan")]),
)
def test_any_model_header_is_merged_within_the_bound_or_refused(header, value):
    svc = _service()
    before = _state(svc)
    limit = svc.node.merge_bound.limit(svc.node.params)
    params = svc.node.params + value
    body = encode(
        {"params": params},
        {
            "kind": "model",
            "spec_hash": svc.spec.hash,
            "version": 1,
            "age": 2,
            "num_examples": 3,
            "sender": HONEST,
            **header,
        },
    )
    try:
        svc.on_gossip(body, 0.0)
    except Rejected as e:
        assert 400 <= e.status < 500
        _unchanged(svc, before)
        return
    assert torch.isfinite(svc.node.params).all()
    assert float(torch.linalg.vector_norm(svc.node.params - before[0])) <= limit * (1 + 1e-5)


def test_second_hand_entries_stay_unverified_until_reached_and_go_at_their_first_failure():
    svc = _service()
    heard = "https://127.0.0.7:9000"
    body = _sh({"sender": HONEST, "entries": [[heard, 0], ["https://169.254.169.254:80", 0]]})
    svc.on_shuffle(body, 0.0)
    m = svc.node.membership
    assert heard in m.view and "https://169.254.169.254:80" not in m.known  # a forbidden kind is dropped
    assert heard not in svc.policy.verified
    assert svc.on_contact_failure(heard, 1.0) and heard not in m.view and heard not in m.known
    assert not svc.on_contact_failure(HONEST, 1.0) and HONEST in m.view  # verified: max_failures apply
    reached = "https://127.0.0.8:9000"
    svc.on_shuffle(_sh({"sender": HONEST, "entries": [[reached, 0]]}), 2.0)
    out = svc.start_shuffle(3.0)
    while out is not None and not out.url.startswith(reached):
        out = svc.start_shuffle(3.0)
    answer = _sh({"sender": reached, "entries": []})
    svc.on_shuffle_reply(reached, answer, 3.1)
    assert reached in svc.policy.verified


def test_a_replayed_or_older_model_is_refused_and_moves_nothing():
    """Every push carries its sender's counter (wall-clock microseconds): a replay, or an older push
    overtaken by a newer one, is 409 ``replayed``; one outside the validity (a model recorded long
    ago) is 400 ``expired``; neither moves the model, the age or the view."""
    svc = _service()
    near = svc.node.params + 0.001
    old = _model(svc, near, age=svc.node.age + 1, seq=5_000_000)
    newer = _model(svc, near, age=svc.node.age + 1, seq=6_000_000)
    svc.on_gossip(newer, 6.0)
    for body in (newer, old):  # the same push again, and an older one after the newer
        _refused(svc, lambda b=body: svc.on_gossip(b, 6.5), 409, "replayed")
    stale = _model(svc, near, age=svc.node.age + 1, seq=7_000_000)
    _refused(svc, lambda: svc.on_gossip(stale, 7.0 + 31.0), 400, "expired")  # 31 s later: past the validity
    ahead = _model(svc, near, age=svc.node.age + 1, seq=200_000_000)
    _refused(svc, lambda: svc.on_gossip(ahead, 7.0), 400, "expired")  # a clock 3 minutes ahead
    fresh = _model(svc, near, age=svc.node.age + 1, seq=8_000_000)
    merges = svc.node.merges
    svc.on_gossip(fresh, 8.0)
    assert svc.node.merges == merges + 1
    shuffle = _sh({"sender": HONEST, "entries": [], "seq": 9_000_000})
    svc.on_shuffle(shuffle, 9.0)
    _refused(svc, lambda: svc.on_shuffle(shuffle, 9.1), 409, "replayed")
    _refused(svc, lambda: svc.on_shuffle(_sh({"sender": HONEST, "entries": []}), 9.1), 409)  # counter 1..: older


def test_with_certificates_a_sender_is_bound_to_the_callers_certificate():
    """A certified peer takes a message only when the caller's client certificate covers the sender
    it names: none (403 client_certificate_required) or another host's (403 sender_mismatch) is
    refused with nothing moved, not even the sender's freshness (the same message then goes through)."""
    from shoal.p2p.identity import cert_hosts

    spec = ParamSpec.of(build_model("logreg", (20,), 4))
    params = 0.1 * torch.randn(spec.numel, generator=torch.Generator().manual_seed(0))
    svc = PeerService(Config(), spec, params, 30, ME, (HONEST,), certified=True)
    svc.node.local_update(params + 0.01)
    body = _model(svc, svc.node.params + 0.001, age=svc.node.age + 1)
    shuffle = _sh({"sender": HONEST, "entries": []})
    other = cert_hosts({"subjectAltName": (("DNS", "evil.example"), ("IP Address", "10.0.0.9"))})
    for identity, code in ((None, "client_certificate_required"), (other, "sender_mismatch")):
        _refused(svc, lambda i=identity: svc.on_gossip(body, 0.0, i), 403, code)
        _refused(svc, lambda i=identity: svc.on_shuffle(shuffle, 0.0, i), 403, code)
    mine = cert_hosts({"subjectAltName": (("DNS", "localhost"), ("IP Address", "127.0.0.1"))})
    merges = svc.node.merges
    svc.on_gossip(body, 0.0, mine)
    svc.on_shuffle(shuffle, 0.0, mine)
    assert svc.node.merges == merges + 1
    assert cert_hosts({}) is None and cert_hosts(None) is None  # no client certificate presented
    plain = _service()  # without certificates the sender is what the message says
    plain.on_gossip(_model(plain, plain.node.params + 0.001, age=plain.node.age + 1), 0.0, None)


def test_a_body_is_parsed_once_off_the_service_and_deep_or_huge_ones_are_refused():
    """PeerService.parse is pure (the transport runs it in a worker thread for large bodies): it
    returns the refusal instead of raising and moves nothing; the service then answers a deeply
    nested header 400 and a body over the limit 413, state untouched, and keeps serving."""
    from shoal.errors import TooLarge

    svc = _service()
    nested: object = 1
    for _ in range(500):
        nested = [nested]
    deep = _raw_model(svc, svc.node.params.clone(), {"age": nested})
    deeper = json.dumps({"sender": HONEST, "entries": [], "x": nested}).encode()
    huge = b"x" * (svc.max_bytes + 1)
    before = _state(svc)
    parsed = [svc.parse("gossip", deep), svc.parse("shuffle", deeper), svc.parse("gossip", huge)]
    assert isinstance(parsed[0], Malformed) and isinstance(parsed[1], Malformed) and isinstance(parsed[2], TooLarge)
    _unchanged(svc, before)
    assert svc.rejected == 0
    _refused(svc, lambda: svc.on_gossip(parsed[0], 0.0), 400, "malformed")
    _refused(svc, lambda: svc.on_shuffle(parsed[1], 0.0), 400, "malformed")
    _refused(svc, lambda: svc.on_gossip(parsed[2], 0.0), 413)
    good = svc.parse("gossip", _model(svc, svc.node.params + 0.001, age=svc.node.age + 1))
    merges = svc.node.merges
    svc.on_gossip(good, 1.0)  # a body parsed elsewhere is taken like one parsed in place
    assert svc.node.merges == merges + 1


def test_an_insider_advertising_50_sybil_addresses_cannot_stop_merges_or_stay_in_the_directory():
    """PeerService objects on a virtual clock: one peer, four honest peers that answer, and an
    insider that for 60 s sends it 4 messages a second (two shuffles naming addresses out of 50
    made up, two pushes from made-up senders) and answers shuffles with made-up addresses too. Every
    peer trains, shuffles and exchanges once a second (contacts within the address policy's
    rate). The peer's exchanges merge at least every 5 s throughout; its directory never holds
    more than its bound, and 30 s after the attack no made-up entry is left (deferred or failed
    contacts drop them, the directory forgets what no one vouches for). Made-up entries hold
    under half its view on average during the attack (0.555 before Brahms's view mix and history
    samplers, 0.43 to 0.44 after, over three runs with OS-drawn sampler keys); its samplers hold
    no more than the made-up share of the distinct addresses it learned (50 of 55) during the
    attack, none 30 s after it, and its /status counts them."""
    from shoal.p2p.service import MAX_KNOWN

    honest = [f"https://127.0.0.1:{9001 + i}" for i in range(4)]
    evil = "https://127.0.0.1:9666"
    sybils = [f"https://127.0.0.1:{10000 + k}" for k in range(50)]
    spec = ParamSpec.of(build_model("logreg", (20,), 4))
    params = 0.1 * torch.randn(spec.numel, generator=torch.Generator().manual_seed(0))
    peers = {}
    for url in [ME, *honest]:
        peers[url] = PeerService(Config(), spec, params.clone(), 30, url, tuple(h for h in honest if h != url), False)
        peers[url].node.local_update(params + 0.01)
    svc, m = peers[ME], peers[ME].node.membership
    seq = itertools.count(1)
    gen = torch.Generator().manual_seed(1)

    def us(now: float) -> int:  # a fresh counter at ``now`` (the senders' clocks agree with ours)
        return int(now * 1e6) + next(seq) % 1000

    def target(url: str, path: str) -> str:
        return url[: -len(path)]

    last_merge, worst_gap, most_fake, fake_at_90 = 0.0, 0.0, 0, -1
    view_shares, sampler_shares = [], []
    for step in range(91 * 4):
        now = step / 4
        if now < 60:
            if step % 2 == 0:  # a shuffle naming four made-up addresses
                names = [[sybils[(step * 3 + k) % 50], 0] for k in range(4)]
                svc.on_shuffle(_sh({"sender": evil, "entries": names, "seq": us(now)}), now)
            else:  # a push from a made-up sender
                fake = sybils[(step * 7) % 50]
                svc.on_gossip(_model(svc, svc.node.params + 0.001, sender=fake, seq=us(now)), now)
        if step % 4 == 0:
            for p in peers.values():  # every peer trains once a second (a local step restarts the drift budget)
                p.node.local_update(p.node.params + 0.001 * torch.randn(spec.numel, generator=gen))
            merges = svc.node.merges
            for p in peers.values():  # every peer shuffles and exchanges once a second
                out = p.start_shuffle(now)
                if out is not None:
                    to = target(out.url, "/shuffle")
                    if to in peers:
                        p.on_shuffle_reply(to, peers[to].on_shuffle(out.body, now), now)
                    elif to == evil and now < 60:
                        names = [[sybils[(step + k) % 50], 0] for k in range(4)]
                        p.on_shuffle_reply(to, _sh({"sender": evil, "entries": names, "seq": us(now)}), now)
                    else:
                        p.on_contact_failure(to, now)  # a made-up address: nothing answers
                out = p.start_exchange(now)
                if out is not None:
                    to = target(out.url, "/gossip")
                    if to in peers:
                        p.on_exchange_reply(to, peers[to].on_gossip(out.body, now), now)
                    else:
                        p.on_contact_failure(to, now)
            if svc.node.merges > merges:
                last_merge = now
        worst_gap = max(worst_gap, now - last_merge)
        fake_now = sum(p in sybils for p in m.known)
        most_fake = max(most_fake, fake_now)
        if now < 60 and step % 4 == 0:
            view_shares.append(sum(p in sybils for p in m.view) / max(len(m.view), 1))
            sampler_shares.append(sum(p in sybils for p in m.history.held()) / len(m.history.held()))
        if now == 90:
            fake_at_90 = fake_now
            assert not [p for p in m.history.held() if p in sybils]
    assert worst_gap <= 5.0, worst_gap
    assert sum(view_shares) / len(view_shares) < 0.5, sum(view_shares) / len(view_shares)
    assert sum(sampler_shares) / len(sampler_shares) <= 50 / 55, sum(sampler_shares) / len(sampler_shares)
    status = svc.counters()
    assert status["sampler_resets"] > 0 and 1 <= status["history"] <= m.samplers
    assert len(m.known) <= MAX_KNOWN and most_fake <= 50
    assert fake_at_90 == 0, [p for p in m.known if p in sybils]
    assert m.floods > 0  # the insider's pushes beyond the rate changed nothing
