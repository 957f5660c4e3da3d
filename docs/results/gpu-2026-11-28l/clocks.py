"""Each GPU's mean SM clock and power, and its last throttle-reason bit set, per window of call 12's nvidia-smi
samples (``call-12-smi.csv``, every 100 ms), from a bench run's start (``call-12-w.txt``'s ``start`` lines, the
same machine's clock). Reason 0x4 is the software power cap (700 W), 0x1 idle.

    python clocks.py call-12-smi.csv START_SECONDS FROM TO [STEP]
"""
import csv
import datetime
import sys


def stamp(text):
    return datetime.datetime.strptime(text.strip(), "%Y/%m/%d %H:%M:%S.%f").replace(
        tzinfo=datetime.timezone.utc).timestamp()


rows = [(int(r[0]), stamp(r[1]), float(r[2]), float(r[3]), r[5].strip())
        for r in csv.reader(open(sys.argv[1])) if len(r) >= 6]
t0, lo, hi = float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
step = float(sys.argv[5]) if len(sys.argv) > 5 else 0.5
t = lo
while t < hi:
    line = f"{t:6.2f}s"
    for gpu in (0, 1):
        got = [r for r in rows if r[0] == gpu and t0 + t <= r[1] < t0 + t + step]
        if got:
            line += (f" | gpu{gpu} {sum(r[2] for r in got) / len(got):5.0f} MHz {sum(r[3] for r in got) / len(got):4.0f} W"
                     f" {got[-1][4][-1]}")
    print(line)
    t += step
