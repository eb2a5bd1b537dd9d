"""Cost of one grading-bridge call, waited for (synchronous) and deferred, side by side.

    .venv/bin/python benchmarks/bridge_calls.py [--calls 100000] [--rounds 3]

The two ends of ``sandbox.bridge`` in two processes over two pipes, as the grader joins
them (no sandbox, no pytest: the bridge alone), the solution's end serving an LRU cache (the demo task
lru_cache's reference solution). The tests' end runs lru_cache's call-heavy loop
(``put`` + ``get`` as statements, results unused) as a test function would, once with every
call waiting for its answer and once with deferral on (``Connection.try_defer``), the two
taking turns in each round. Prints, per mode, the median over rounds of wall time and CPU
time of each side per call, the CPU it ran on and the load average.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sandbox import bridge  # noqa: E402

SOLUTION = ROOT / "tasks" / "demo" / "lru_cache" / "solution"


def _run_test(test):
    """Stands in for pytest's pytest_pyfunc_call: the frame deferral stops at."""
    return test()


def _one(calls: int, defer: bool) -> dict[str, float]:
    to_solution, to_tests = os.pipe(), os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the solution's end
        os.close(to_solution[1])
        os.close(to_tests[0])
        sys.path.append(str(SOLUTION))
        conn = bridge.Connection((to_solution[0], to_tests[1]), "solution")
        start = resource.getrusage(resource.RUSAGE_SELF)
        conn.serve_forever()
        end = resource.getrusage(resource.RUSAGE_SELF)
        os.write(ready_w, f"{end.ru_utime - start.ru_utime + end.ru_stime - start.ru_stime}".encode())
        os._exit(0)
    os.close(to_solution[0])
    os.close(to_tests[1])
    os.close(ready_w)
    conn = bridge.Connection((to_tests[0], to_solution[1]), "tests")
    cache = conn.rpc("import", "lru").LRUCache(1000)

    def test():
        for i in range(calls // 2):
            cache.put(i, i)
            cache.get(i - 500)
        assert len(cache) == 1000

    if defer:
        conn.defer_calls_from(_run_test.__code__)
    conn.begin_call()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    _run_test(test)
    conn.end_call()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    os.close(to_solution[1])  # EOF: the solution's end returns
    os.close(to_tests[0])
    os.waitpid(pid, 0)
    solution_cpu = float(os.read(ready_r, 100).decode())
    os.close(ready_r)
    return {"wall": wall / calls * 1e6, "tests": cpu / calls * 1e6, "solution": solution_cpu / calls * 1e6}


def _cpu() -> str:
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cpus)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"waited": [], "deferred": []}
    for _ in range(args.rounds):
        for mode in results:
            results[mode].append(_one(args.calls, mode == "deferred"))
    print(f"bridge cost per call, {args.calls} calls (lru_cache loop), median of {args.rounds}; {_cpu()}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'mode':<10}{'wall us':>10}{'tests cpu us':>14}{'solution cpu us':>17}")
    rows = {}
    for mode, runs in results.items():
        rows[mode] = {k: statistics.median(r[k] for r in runs) for k in ("wall", "tests", "solution")}
        print(f"{mode:<10}{rows[mode]['wall']:>10.1f}{rows[mode]['tests']:>14.1f}{rows[mode]['solution']:>17.1f}")
    ratio = {k: rows["deferred"][k] / rows["waited"][k] for k in ("wall", "tests", "solution")}
    print(f"{'ratio':<10}{ratio['wall']:>10.2f}{ratio['tests']:>14.2f}{ratio['solution']:>17.2f}")


if __name__ == "__main__":
    main()
