"""`make load`: the real server under locust at several user counts, summarised and plotted.

Starts `python -m predictor` on free loopback ports, then for each --users level runs
`locust --headless` (closed loop: N users, each sending its next request when the last ends) for
--seconds, stops the server and writes into --out: `u{N}_stats.csv` etc. and `u{N}.html` (locust),
`server.log`, `summary.csv`, `summary.txt` and `load.png`. Metrics come from load/locustfile.py's
TTFT / TPOT / TOKENS entries. When the time is up, requests in flight are allowed to finish
(`--stop-timeout`): none is cut off, so long requests are not under-sampled and no generated
token is lost. Rates (requests/s, output tokens/s = the TOKENS entries' total) are therefore
divided by locust's measured window (first user start to last completed request, i.e. its
Requests/s column), which is --seconds plus that drain; --seconds when the window is unknown.
Server flags can be set through their PREDICTOR_* environment variables (e.g. PREDICTOR_THREADS).

    .venv/bin/python -m load.run_load [--users 1 4 16] [--seconds 30] [--user-class ...]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from load.local_server import local_server

REPO = Path(__file__).resolve().parent.parent
LOCUSTFILE = REPO / "load" / "locustfile.py"
METRICS = ("TTFT", "TPOT", "TOKENS")
STOP_TIMEOUT = 120  # seconds locust waits for requests in flight at the end of a level
COLUMNS = ("users", "requests", "failures", "req_per_s", "ttft_p50_ms", "ttft_p95_ms",
           "tpot_p50_ms", "tokens_per_request", "output_tokens_per_s")  # fmt: skip
HEADERS = ("users", "requests", "failures", "req/s", "TTFT p50 ms", "TTFT p95 ms",
           "TPOT p50 ms", "tokens/req", "output tok/s")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--seconds", type=int, default=30, help="run time per users level")
    parser.add_argument("--user-class", nargs="+", default=["GenerateStreamUser"],
                        help="locust user class(es) from load/locustfile.py")  # fmt: skip
    parser.add_argument("--model-dir", type=Path, default=Path("models/smollm2-135m-instruct-gptq"))
    parser.add_argument("--out", type=Path, default=Path("load/out"))
    return parser.parse_args(argv)


def warm_up(url: str, model: str) -> None:
    """One short request first, so the first level does not pay for one-time work."""
    body = json.dumps({"text_input": "Hello", "parameters": {"max_tokens": 8}}).encode()
    request = urllib.request.Request(f"{url}/v2/models/{model}/generate", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()


def run_locust(users: int, seconds: int, classes: list[str], host: str, out: Path,
               env: dict[str, str]) -> int:  # fmt: skip
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "-u", str(users), "-r", str(users), "-t", f"{seconds}s", "--host", host,
        "--csv", str(out / f"u{users}"), "--html", str(out / f"u{users}.html"),
        "--stop-timeout", str(STOP_TIMEOUT), "--only-summary", *classes,
    ]  # fmt: skip
    print(f"--- {users} users, {seconds} s: {' '.join(classes)}", flush=True)
    return subprocess.run(
        command, cwd=REPO, env=env, timeout=seconds + STOP_TIMEOUT + 120
    ).returncode


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:  # "N/A"
        return math.nan


def _weighted(rows: list[dict[str, str]], column: str) -> float:
    """One figure over several entries (several endpoints): their count-weighted mean."""
    pairs = [(_number(r["Request Count"]), _number(r[column])) for r in rows]
    pairs = [(n, v) for n, v in pairs if n > 0 and not math.isnan(v)]
    total = sum(n for n, _ in pairs)
    return sum(n * v for n, v in pairs) / total if total else math.nan


def level_summary(stats_csv: Path, users: int, seconds: float) -> dict[str, float]:
    """One row of the summary from locust's `u{N}_stats.csv` (NaN where there is nothing)."""
    row: dict[str, float] = dict.fromkeys(COLUMNS, math.nan)
    row["users"] = users
    if not stats_csv.is_file():
        return row
    with stats_csv.open(newline="") as handle:
        entries = [r for r in csv.DictReader(handle) if r["Name"] != "Aggregated"]
    calls = [r for r in entries if r["Type"] not in METRICS]
    by_type = {m: [r for r in entries if r["Type"] == m] for m in METRICS}
    row["requests"] = sum(_number(r["Request Count"]) for r in calls)
    row["failures"] = sum(_number(r["Failure Count"]) for r in calls)
    # locust's window: Request Count / Requests/s is the same for every row (start to last call)
    windows = [_number(r["Request Count"]) / _number(r["Requests/s"]) for r in entries
               if _number(r["Request Count"]) > 0 and _number(r["Requests/s"]) > 0]  # fmt: skip
    elapsed = windows[0] if windows else seconds
    row["req_per_s"] = row["requests"] / elapsed
    row["ttft_p50_ms"] = _weighted(by_type["TTFT"], "50%")
    row["ttft_p95_ms"] = _weighted(by_type["TTFT"], "95%")
    row["tpot_p50_ms"] = _weighted(by_type["TPOT"], "50%")
    # TOKENS entries carry the token count as their "response time": average x count = total
    tokens = [(_number(r["Request Count"]), _number(r["Average Response Time"]))
              for r in by_type["TOKENS"]]  # fmt: skip
    total = sum(n * avg for n, avg in tokens if n > 0)
    count = sum(n for n, _ in tokens)
    row["tokens_per_request"] = total / count if count else math.nan
    row["output_tokens_per_s"] = total / elapsed
    return row


def _cell(value: float) -> str:
    if math.isnan(value):
        return "-"
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def summarise(out_dir: Path, levels: list[int], seconds: float) -> str:
    """Reads `{out_dir}/u{N}_stats.csv` per level; writes summary.csv/.txt and load.png."""
    out_dir = Path(out_dir)
    rows = [level_summary(out_dir / f"u{n}_stats.csv", n, seconds) for n in levels]
    with (out_dir / "summary.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        writer.writerows(["" if math.isnan(row[c]) else f"{row[c]:.6g}" for c in COLUMNS]
                         for row in rows)  # fmt: skip
    cells = [HEADERS, *([_cell(row[c]) for c in COLUMNS] for row in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(HEADERS))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    text = (f"{seconds:g} s per level (+ requests in flight finishing); TTFT/TPOT in ms; "
            "req/s and output tok/s over locust's measured window\n"
            + "\n".join(lines) + "\n")  # fmt: skip
    (out_dir / "summary.txt").write_text(text)
    plot(rows, out_dir / "load.png")
    return text


def plot(rows: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    users = [int(row["users"]) for row in rows]
    fig, (latency, rate) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p95_ms", "TTFT p95"),
                       ("tpot_p50_ms", "TPOT p50")):  # fmt: skip
        latency.plot(users, [row[key] for row in rows], marker="o", label=label)
    latency.set(xlabel="concurrent users", ylabel="ms", title="Latency")
    latency.legend()
    rate.plot(users, [row["output_tokens_per_s"] for row in rows], marker="o", color="tab:green")
    rate.set(xlabel="concurrent users", ylabel="output tokens/s", title="Throughput")
    for ax in (latency, rate):
        if len(set(users)) > 1 and min(users) > 0:
            ax.set_xscale("log", base=2)
        ax.set_xticks(users, [str(u) for u in users])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir.resolve()
    model_name = model_dir.name
    codes = []
    log_path = out / "server.log"
    with local_server(str(model_dir), model_name, log_path) as server:
        host = server.base_url
        print(f"server {model_dir} on {host} (gRPC {server.grpc_port}), log {log_path}", flush=True)
        env = dict(
            os.environ, LOAD_MODEL=model_name, LOAD_GRPC_TARGET=f"127.0.0.1:{server.grpc_port}"
        )
        warm_up(host, model_name)
        for users in args.users:
            codes.append(run_locust(users, args.seconds, args.user_class, host, out, env))
    text = summarise(out, args.users, args.seconds)
    print(f"\n{text}\nwritten to {out}: summary.csv, summary.txt, load.png, u<N>_*.csv, u<N>.html")
    if any(codes):
        print(f"locust exit codes {codes}: some runs had failures (see the CSV files)")
    return 1 if any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
