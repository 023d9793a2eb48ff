"""Reads the simulated driver's per-process SM use as a monitoring agent would, independently of
the guardian, and prints each process's time-weighted mean.

    python sm_sampler.py SECONDS INTERVAL PID...   (with the simulated driver's environment)

Prints ``sampling``, then reads ``nvmlDeviceGetProcessUtilization`` on every device every INTERVAL
seconds until each PID's readings span SECONDS, then prints one JSON line:
``{"<pid>": {"mean": %, "seconds": s, "reads": n}}``. Each of the driver's readings is the process's
mean since the previous read by this process, so the readings weighted by the time between them add
up to the use over the whole span, whatever the cadence the load gives this loop; the first reading
(the use at an instant) only starts the span. The span is counted, not the wall time, so a loop the
load holds back reads longer instead of covering less; a PID the driver stops listing is given up
on after twice SECONDS and a minute (its span then says how much was covered).

Used by the integration test of the guardian's freezer and by the node bed's (``tests/e2e/node``)."""

from __future__ import annotations

import json
import sys
import time

import pynvml


def main() -> None:
    seconds, interval = float(sys.argv[1]), float(sys.argv[2])
    pids = {int(p) for p in sys.argv[3:]}
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    area = dict.fromkeys(pids, 0.0)
    span = dict.fromkeys(pids, 0.0)
    reads = dict.fromkeys(pids, 0)
    last: dict[int, float] = {}
    print("sampling", flush=True)
    give_up = time.monotonic() + 2 * seconds + 60
    while min(span.values()) < seconds and time.monotonic() < give_up:
        for handle in handles:
            try:
                samples = pynvml.nvmlDeviceGetProcessUtilization(handle, 0)
            except pynvml.NVMLError_NotFound:
                continue  # no sample newer than the last: the next read covers this span
            now = time.monotonic()
            for s in samples:
                if s.pid not in pids:
                    continue
                if s.pid in last:
                    area[s.pid] += s.smUtil * (now - last[s.pid])
                    span[s.pid] += now - last[s.pid]
                    reads[s.pid] += 1
                last[s.pid] = now
        time.sleep(interval)
    print(json.dumps({str(p): {"mean": area[p] / span[p] if span[p] else None, "seconds": round(span[p], 3),
                               "reads": reads[p]} for p in pids}), flush=True)


if __name__ == "__main__":
    main()
