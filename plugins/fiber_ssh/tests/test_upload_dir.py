"""The decisions about an upload directory (fiber_ssh.upload_dir), without a host."""

from __future__ import annotations

import re
import stat

from fiber_ssh.upload_dir import configured_dir_problem, fresh_dir_problem, fresh_name

ME, OTHER = 1000, 65534
DIR, LINK, FILE = stat.S_IFDIR, stat.S_IFLNK, stat.S_IFREG


def test_fresh_names_are_new_each_time_and_say_the_run() -> None:
    names = {fresh_name("abc123") for _ in range(100)}
    assert len(names) == 100
    assert all(re.fullmatch(r"fiberupload-abc123-[0-9a-f]{32}", n) for n in names)
    assert fresh_name("").startswith("fiberupload-run-")


def test_a_fresh_directory_is_used_only_as_a_private_directory_of_ours() -> None:
    assert fresh_dir_problem(DIR | 0o700, ME, ME) is None
    assert fresh_dir_problem(LINK | 0o777, ME, ME) == "it is a symbolic link"
    assert fresh_dir_problem(FILE | 0o700, ME, ME) == "it is not a directory"
    assert fresh_dir_problem(DIR | 0o700, OTHER, ME) == "it belongs to uid 65534, not to the login's uid 1000"
    assert fresh_dir_problem(DIR | 0o755, ME, ME) == "its mode is 0755, not 0700"
    assert fresh_dir_problem(DIR | 0o1700, ME, ME) == "its mode is 1700, not 0700"


def test_a_configured_directory_is_used_if_ours_and_no_one_else_writes_in_it() -> None:
    assert configured_dir_problem(DIR | 0o755, ME, ME) is None  # readable: the user's choice
    assert configured_dir_problem(DIR | 0o700, ME, ME) is None
    assert configured_dir_problem(DIR | 0o700, OTHER, ME) == \
        "it belongs to uid 65534, not to the login's uid 1000"
    assert configured_dir_problem(DIR | 0o775, ME, ME) == \
        "others may write in it (mode 0775): chmod go-w it"
    assert configured_dir_problem(DIR | 0o1777, ME, ME) == \
        "others may write in it (mode 1777): chmod go-w it"
    assert configured_dir_problem(FILE | 0o600, ME, ME) == "it is not a directory"
