"""A stdlib multiprocessing program; only the import line names Fiber."""

import fiber_core as multiprocessing


def square(x, results):
    print(f"squaring {x}")
    results.put((x, x * x))


if __name__ == "__main__":
    results = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=square, args=(i, results)) for i in range(4)]
    for p in procs:
        p.start()
    print(sorted(results.get() for _ in procs))
    for p in procs:
        p.join()
