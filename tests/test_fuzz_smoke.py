"""CI smoke run of the fuzz targets (fuzz/): the seed corpus, then bounded hypothesis inputs,
through the same harness atheris drives (no atheris needed here): the protocol targets, the
load report, the fleet's (the store's replies, DNS answers over time), and an engine's
KV-cache events."""

from __future__ import annotations

import pathlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.fleetcases import check_discovery, check_store
from fuzz.harness import KINDS, check_report, decode, fleet_of, llm_of, run_case, stop_of
from fuzz.kvcases import check as check_kv_events

CORPUS = pathlib.Path(__file__).resolve().parent.parent / "fuzz" / "corpus"
SEEDS = sorted((kind, path) for kind in KINDS for path in (CORPUS / kind).iterdir())


@pytest.mark.parametrize(("kind", "path"), SEEDS, ids=[f"{k}/{p.name}" for k, p in SEEDS])
def test_seed_corpus_keeps_every_invariant(kind: str, path: pathlib.Path) -> None:
    raw = path.read_bytes()
    data, splits = decode(raw)
    run_case(kind, data, splits, stop=stop_of(raw), llm=llm_of(raw), fleet=fleet_of(raw))


def test_every_target_has_seeds() -> None:
    assert {kind for kind, _ in SEEDS} == set(KINDS)
    # ... and seeds with the fleet store (the RESERVING wait, shared sessions).
    assert {kind for kind, path in SEEDS if fleet_of(path.read_bytes()) is not None} == set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_mutated_seeds_keep_every_invariant(kind: str, data: st.DataObject) -> None:
    seeds = [decode(path.read_bytes())[0] for k, path in SEEDS if k == kind]
    seed = data.draw(st.sampled_from(seeds))
    # Flip, cut or insert a few bytes of a real conversation: close to valid, so deep paths run.
    mutated = bytearray(seed)
    for _ in range(data.draw(st.integers(0, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = data.draw(st.integers(0, len(mutated)))
        if op == "flip" and at < len(mutated):
            mutated[at] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del mutated[at : at + data.draw(st.integers(1, 16))]
        else:
            mutated[at:at] = data.draw(st.binary(max_size=16))
    splits = data.draw(st.lists(st.integers(0, len(mutated)), max_size=6))
    stop = data.draw(st.sampled_from([None, 0.0, 1.0, 3.0]))
    fleet = data.draw(st.none() | st.integers(0, 255))
    run_case(kind, bytes(mutated), splits, stop=stop, llm=data.draw(st.booleans()), fleet=fleet)


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(KINDS), raw=st.binary(max_size=256), splits=st.lists(st.integers()))
def test_random_bytes_keep_every_invariant(kind: str, raw: bytes, splits: list[int]) -> None:
    run_case(kind, raw, [abs(s) for s in splits], llm=len(raw) % 2 == 1)


REPORTS = sorted((CORPUS / "load_report").iterdir())


@pytest.mark.parametrize("path", REPORTS, ids=[p.name for p in REPORTS])
def test_load_report_seeds_keep_the_parsers_promises(path: pathlib.Path) -> None:
    check_report(path.read_bytes())


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_mutated_load_reports_keep_the_parsers_promises(data: st.DataObject) -> None:
    seed = bytearray(data.draw(st.sampled_from(REPORTS)).read_bytes())
    for _ in range(data.draw(st.integers(1, 6))):
        at = data.draw(st.integers(0, len(seed)))
        seed[at:at] = data.draw(st.binary(max_size=12))
    check_report(bytes(seed))


FLEET_TARGETS = {
    "fleet_store": check_store,
    "discovery": check_discovery,
    "kv_events": check_kv_events,  # an engine's KV-event stream and tokenize answers
}
FLEET_SEEDS = sorted(
    (target, path) for target in FLEET_TARGETS for path in (CORPUS / target).iterdir()
)


@pytest.mark.parametrize(
    ("target", "path"), FLEET_SEEDS, ids=[f"{t}/{p.name}" for t, p in FLEET_SEEDS]
)
def test_fleet_seeds_keep_every_invariant(target: str, path: pathlib.Path) -> None:
    FLEET_TARGETS[target](path.read_bytes())


def test_every_fleet_target_has_seeds() -> None:
    assert {target for target, _ in FLEET_SEEDS} == set(FLEET_TARGETS)


@pytest.mark.parametrize("target", sorted(FLEET_TARGETS))
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_mutated_fleet_seeds_keep_every_invariant(target: str, data: st.DataObject) -> None:
    seeds = [path for t, path in FLEET_SEEDS if t == target]
    seed = bytearray(data.draw(st.sampled_from(seeds)).read_bytes())
    for _ in range(data.draw(st.integers(1, 6))):
        at = data.draw(st.integers(0, len(seed)))
        if data.draw(st.booleans()) and at < len(seed):
            seed[at] = data.draw(st.integers(0, 255))
        else:
            seed[at:at] = data.draw(st.binary(max_size=12))
    FLEET_TARGETS[target](bytes(seed))
