"""tqdm progress bars over Pool.imap and Pool.imap_unordered, as docs/progress.md shows them."""

from __future__ import annotations

import json
import re

N = 24

SLOW = 1.0
"""Seconds the last item takes; the others take 0.05."""

PROGRAM = f"""
import json, sys, time
from tqdm import tqdm
import fiber_core as multiprocessing

def work(x):
    time.sleep({SLOW} if x == {N} - 1 else 0.05)
    return x * x

def bar(it, desc):
    # the loop of docs/progress.md, noting when the bar moved to each count
    seen = []
    for r in tqdm(it, total={N}, desc=desc, ascii=True, mininterval=0, miniters=1):
        seen.append((r, time.monotonic()))
    return [r for r, _ in seen], seen[-1][1] - seen[-2][1]

if __name__ == "__main__":
    with multiprocessing.Pool(2) as pool:
        ordered, wait_ordered = bar(pool.imap(work, range({N})), "imap")
        unordered, wait_unordered = bar(pool.imap_unordered(work, range({N})), "unordered")
    print(json.dumps({{"ordered": ordered == [x * x for x in range({N})],
                      "unordered": sorted(unordered) == [x * x for x in range({N})],
                      "waits": [wait_ordered, wait_unordered]}}))
"""


def _counts(stderr: str, desc: str) -> list[int]:
    """The counts a bar named ``desc`` showed, in the order it drew them."""
    frames = re.split(r"[\r\n]+", stderr)
    return [int(m.group(1)) for f in frames if f.startswith(f"{desc}:")
            for m in [re.search(rf"\| *(\d+)/{N} \[", f)] if m]


def test_tqdm_over_imap_and_imap_unordered_reaches_n_of_n(run_script) -> None:  # noqa: ANN001
    out = run_script(PROGRAM)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["ordered"] and result["unordered"], result
    # The bar stood at N-1 while the slow last item ran: the results came as they were done,
    # not all together at the end of the map.
    assert min(result["waits"]) > SLOW / 2, result
    for desc in ("imap", "unordered"):
        counts = _counts(out.stderr, desc)
        assert counts, f"no {desc} bar in: {out.stderr[-2000:]}"
        assert counts[-1] == N, (desc, counts)
        assert f"{desc}: 100%" in out.stderr
        assert counts == sorted(counts) and counts[0] == 0 and N - 1 in counts, (desc, counts)
