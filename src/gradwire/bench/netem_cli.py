"""The `--netem` side of `gradwire bench`: the matrix, its table, JSON lines, plot and docs section."""

from __future__ import annotations

import argparse
import datetime
import re
import shlex
import sys

from gradwire.bench.netem import DEFAULT_CONFIGS, Record, plot, run_config, table, to_json
from gradwire.netem import NetemUnavailable, Topology
from gradwire.netem.cluster import check_available

BEGIN, END = "<!-- netem:begin -->", "<!-- netem:end -->"


def parse_configs(text: str | None) -> list[tuple[int, int, str, str]]:
    if not text:
        return DEFAULT_CONFIGS
    out = []
    for item in text.split(","):
        n, k, wr, sr = item.split(":")
        out.append((int(n), int(k), wr, sr))
    return out


def run_netem(args: argparse.Namespace, sizes: list[int], env: dict[str, str]) -> int:
    try:
        check_available()
    except NetemUnavailable as e:
        print(f"gradwire bench --netem: {e}", file=sys.stderr)
        return 2
    results: list[list[Record]] = []
    for n, k, worker_rate, server_rate in parse_configs(args.configs):
        topo = Topology(n, k, worker_rate, server_rate)
        records = run_config(topo, sizes, args.repeats, args.warmup, topo.tuning() | env)
        results.append(records)
        if args.json:
            for r in records:
                print(to_json(r), flush=True)
        else:
            print(table([records]), flush=True)  # progress: each configuration as it completes
    text = table(results)
    if not args.json:
        print("\n" + text)
    flat = [r for rs in results for r in rs]
    if args.plot:
        plot(flat, args.plot)
    if args.write_docs:
        _write_docs(args.write_docs, text, args.plot, env)
    return 0


def _write_docs(path: str, text: str, plot_path: str | None, env: dict[str, str]) -> None:
    command = "sudo .venv/bin/gradwire " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    overrides = ", ".join(f"{k}={v}" for k, v in sorted(env.items()))
    settings = (("overrides " + overrides + "; otherwise ") if overrides else "") + (
        "per configuration Topology.tuning(): 64 KiB partitions, window 4, at most 4 unanswered per server below "
        "8 workers; 16 KiB, window 8, 16 unanswered from 8 workers (the partition, window column)"
    )
    section = (
        f"{BEGIN}\n```bash\n{command}\n```\nMeasured {datetime.date.today()}, gradwire settings: {settings}.\n\n"
        f"{text}\n" + ("\n![time against n](netem.png)\n" if plot_path else "") + f"{END}"
    )
    with open(path) as f:
        doc = f.read()
    if BEGIN in doc:
        doc = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: section, doc, flags=re.S)
    else:
        doc = doc.rstrip() + "\n\n## Emulated network (issue 4)\n\n" + section + "\n"
    with open(path, "w") as f:
        f.write(doc)
