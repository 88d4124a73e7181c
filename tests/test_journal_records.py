"""The journal's record format, its replay decisions and a program's name, without I/O (durable/records.py, replay.py, journal.py)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from fiber_core.base.errors import JournalError
from fiber_core.parallel.durable import records
from fiber_core.parallel.durable.journal import name_program
from fiber_core.parallel.durable.lease import holder_gone
from fiber_core.parallel.durable.records import CallIdentity
from fiber_core.parallel.durable.replay import Recorded, Replay
from fiber_core.parallel.durable.task import seed_of

MAP7 = CallIdentity(0, "map(f)", b"f" * 16, b"a" * 16)
APPLY = CallIdentity(1, "apply_async(g)", b"g" * 16, b"b" * 16)


def _journal(*extra: bytes) -> bytes:
    return (records.MAGIC + records.header("/prog.py", 7) + records.call(MAP7)
            + records.units(0, [(0, b"d0"), (1, b"d1")], [[1, 4], [9]]) + b"".join(extra))


def _recorded(data: bytes) -> Recorded:
    scan = records.scan(data)
    recorded = Recorded()
    for kind, payload in scan.records[1:]:
        recorded.add(kind, payload)
    return recorded


def test_records_read_back_as_written_and_the_header_names_the_program_and_seed() -> None:
    scan = records.scan(_journal())
    assert scan.problem is None and scan.good == len(_journal())
    assert [kind for kind, _ in scan.records] == [records.HEADER, records.CALL, records.UNITS]
    assert records.read_header(scan.records[0][1]) == {"program": "/prog.py", "seed": 7}
    assert records.read_call(scan.records[1][1]) == MAP7
    assert records.read_units(scan.records[2][1]) == (0, [(0, b"d0"), (1, b"d1")], [[1, 4], [9]])


@pytest.mark.parametrize("cut", [1, 5, 9])
def test_a_torn_last_record_is_found_and_the_records_before_it_are_kept(cut: int) -> None:
    whole = _journal(records.call(APPLY))
    scan = records.scan(whole[:-cut])
    assert len(scan.records) == 3
    assert scan.good == len(_journal())
    assert scan.problem is not None and "record 4" in scan.problem and "torn" in scan.problem


def test_a_flipped_bit_is_found_by_the_checksum_and_nothing_after_it_is_read() -> None:
    data = bytearray(_journal(records.call(APPLY)))
    at = len(records.MAGIC) + len(records.header("/prog.py", 7)) + 12  # inside the CALL record
    data[at] ^= 0x10
    scan = records.scan(bytes(data))
    assert len(scan.records) == 1  # the header only
    assert scan.problem is not None and "record 2" in scan.problem and "checksum" in scan.problem


def test_a_file_of_another_format_or_version_is_not_read() -> None:
    assert "not a Fiber journal" in (records.scan(b"PK\x03\x04 a zip file").problem or "")
    other = records.MAGIC[:-1] + bytes([records.VERSION + 1]) + _journal()[len(records.MAGIC):]
    scan = records.scan(other)
    assert scan.records == [] and f"version {records.VERSION + 1}" in (scan.problem or "")


def test_a_matching_call_gets_its_recorded_units_and_the_next_unrecorded_call_ends_the_replay() -> None:
    replay = Replay(_recorded(_journal()))
    verdict = replay.begin(MAP7)
    assert verdict.units == {0: (b"d0", [1, 4]), 1: (b"d1", [9])}
    assert verdict.warning is None and not verdict.truncate
    past = replay.begin(APPLY)
    assert past.units == {} and past.warning is None and not past.truncate
    assert not replay.active


@pytest.mark.parametrize(("changed", "said"), [
    (MAP7._replace(func=b"x" * 16), "function's code differs"),
    (MAP7._replace(args=b"x" * 16), "arguments differ"),
    (MAP7._replace(name="starmap(f)"), "recorded map(f) there"),
])
def test_a_call_that_differs_ends_the_replay_with_one_warning_naming_it(changed: CallIdentity, said: str) -> None:
    replay = Replay(_recorded(_journal(records.call(APPLY), records.units(1, [(0, b"e")], [[5]]))))
    verdict = replay.begin(changed)
    assert verdict.units == {} and verdict.truncate
    assert verdict.warning is not None and "call 0" in verdict.warning and said in verdict.warning
    # What comes after is never handed out, even where it matches.
    assert replay.begin(APPLY) == (({}, False, None))


def test_a_truncate_record_voids_the_call_and_those_after_it() -> None:
    recorded = _recorded(_journal(records.call(APPLY), records.truncate(1), records.call(APPLY._replace(func=b"h" * 16))))
    assert recorded.calls[1].func == b"h" * 16
    assert recorded.counts() == (2, 2)
    recorded = _recorded(_journal(records.truncate(0)))
    assert recorded.counts() == (0, 0)


def test_an_imap_unit_is_taken_only_for_the_same_arguments() -> None:
    stream = MAP7._replace(name="imap(f)", args=b"")
    replay = Replay(_recorded(records.MAGIC + records.header("/p", 1) + records.call(stream)
                              + records.units(0, [(0, b"d0"), (1, b"d1")], [[1], [4]])))
    assert replay.begin(stream).warning is None
    assert replay.unit(stream, 0, b"d0") == (True, [1], None)
    assert replay.unit(stream, 2, b"d2") == (False, None, None)  # not recorded: it runs
    ok, _, warning = replay.unit(stream, 1, b"other")
    assert not ok and warning is not None and "unit 1" in warning
    assert replay.unit(stream, 0, b"d0") == (False, None, None)  # the replay has ended


def test_a_task_seed_depends_on_the_run_the_call_and_the_item_only() -> None:
    seeds = {seed_of(run, call, item) for run in (1, 2) for call in (0, 1) for item in (0, 1)}
    assert len(seeds) == 8
    assert seed_of(1, 0, 0) == seed_of(1, 0, 0)
    assert all(0 <= s < 2**64 for s in seeds)


def test_a_lease_holds_until_it_runs_out_or_its_local_holder_has_ended() -> None:
    lease = {"pid": 42, "host": "h1", "expires": 100.0}
    assert holder_gone(lease, 99.0, "h1", alive=lambda pid: True) is None
    assert "ran out" in (holder_gone(lease, 100.0, "h1", alive=lambda pid: True) or "")
    assert "pid 42 of this host" in (holder_gone(lease, 99.0, "h1", alive=lambda pid: False) or "")
    assert holder_gone(lease, 99.0, "h2", alive=lambda pid: False) is None  # another host's pid
    assert holder_gone({}, 0.0, "h1") is not None  # half written: no expiry


def test_a_holder_whose_lease_was_taken_is_told_when_it_renews_and_lets_the_new_holder_keep_it(tmp_path) -> None:  # noqa: ANN001
    import json
    import os

    from fiber_core.parallel.durable.lease import Lease

    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    lost: list[str] = []
    try:
        lease = Lease(fd, str(tmp_path), lost.append)
        lease.acquire(0)
        assert lease.renew() and lost == []
        # It stalled past its lease and another master took it.
        (tmp_path / "lease").write_text(json.dumps({"pid": 1, "host": "other", "token": "t",
                                                    "expires": 4e9}))
        assert not lease.renew()
        assert lost == ["pid 1 on host other (its lease runs until 07:06:40 UTC)"]
        lease.release()
        assert json.loads((tmp_path / "lease").read_text())["token"] == "t"  # not removed
    finally:
        os.close(fd)


def test_a_reader_of_segments_starts_at_the_newest_base_and_reads_the_rest_in_order() -> None:
    from fiber_core.parallel.durable.stored import segment_order

    names = ["journal/000000000010", "journal/000000000002", "journal/000000000003.base",
             "journal/000000000001", "journal/000000000009", "lease", "set-aside-x"]
    assert segment_order(names) == ["journal/000000000003.base", "journal/000000000009",
                                    "journal/000000000010"]
    assert segment_order(["journal/000000000001", "journal/000000000000"]) == [
        "journal/000000000000", "journal/000000000001"]
    assert segment_order([]) == []


# -- the program a journal belongs to -------------------------------------------------------


def _main(**attrs: str) -> ModuleType:
    """A main module as a script or a notebook's kernel has it."""
    main = ModuleType("__main__")
    for name, value in attrs.items():
        setattr(main, name, value)
    return main


def test_a_script_is_named_by_the_real_path_of_its_file_and_the_program_setting_beats_it(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    (tmp_path / "link.py").symlink_to(script)
    assert name_program(None, _main(__file__=str(tmp_path / "link.py"))) == str(script)
    assert name_program("es-run", _main(__file__=str(script))) == "es-run"


@pytest.mark.parametrize("attr", ["__session__", "__vsc_ipynb_file__"])
def test_a_notebook_is_named_by_the_path_its_kernel_knows_unless_the_setting_names_it(
        tmp_path: Path, attr: str) -> None:
    notebook = tmp_path / "analysis.ipynb"
    notebook.write_text("{}")
    (tmp_path / "link.ipynb").symlink_to(notebook)
    assert name_program(None, _main(**{attr: str(tmp_path / "link.ipynb")})) == str(notebook)
    assert name_program(None, _main(**{attr: "work/analysis.ipynb"})) == "work/analysis.ipynb"
    assert name_program("my-analysis", _main(**{attr: str(notebook)})) == "my-analysis"


@pytest.mark.parametrize("main", [_main(), _main(__session__=""), None])
def test_a_program_without_a_file_or_a_notebook_path_is_refused_saying_what_to_set(main: ModuleType | None) -> None:
    with pytest.raises(JournalError) as raised:
        name_program(None, main)
    assert str(raised.value) == (
        "a journal needs to know which program it belongs to, and this one has no file (a "
        "notebook whose kernel does not know the notebook's path, python -c, a console): name "
        'it with the program setting, fiber_core.init(journal=..., program="my-analysis") or '
        "FIBER_PROGRAM=my-analysis, the same name each time it runs")
