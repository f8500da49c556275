"""The `--netem` side of `gradwire bench`: the matrix, its table, JSON lines, plot and docs section."""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import sys

from gradwire.bench.netem import DEFAULT_CONFIGS, Record, plot, run_config, table, to_json
from gradwire.bench.netem_train import (
    COMPRESSION_WAYS,
    KERAS_WAYS,
    OPT_IN_WAYS,
    PEERS,
    TRAIN_WAYS,
    run_train_config,
    train_table,
)
from gradwire.netem import NetemUnavailable, Topology
from gradwire.netem.cluster import check_available
from gradwire.tuning import ETHERNET_MTU

HEADINGS = {"netem": "Emulated network (issue 4)", "placement": "Colocated servers and placement (issue 5)"}


def parse_configs(text: str | None) -> list[Topology]:
    """`n:k:worker_rate:server_rate`, comma-separated, then optionally `c` (a colocated server on every worker host),
    `xM` (M workers per host, sharing its link: n/M worker hosts) and `mB` (every link's MTU in bytes, 1500 unless
    given): `8:0:100mbit:100mbit:c:x4`, `8:8:50mbit:50mbit:m9000`."""
    if not text:
        return [Topology(*c) for c in DEFAULT_CONFIGS]
    out = []
    for item in text.split(","):
        n, k, wr, sr, *rest = item.split(":")
        colocate = rest[:1] == ["c"]
        rest = rest[1:] if colocate else rest
        per_host = rest.pop(0)[1:] if rest and rest[0][:1] == "x" else "1"
        mtu = rest.pop(0)[1:] if rest and rest[0][:1] == "m" else str(ETHERNET_MTU)
        if rest or not per_host.isdigit() or not mtu.isdigit():
            raise SystemExit(f"gradwire bench --configs: {item!r} is not n:k:worker_rate:server_rate[:c][:xM][:mB]")
        try:
            out.append(Topology(int(n), int(k), wr, sr, colocate=colocate, per_host=int(per_host), mtu=int(mtu)))
        except ValueError as e:
            raise SystemExit(f"gradwire bench --configs: {item!r}: {e}") from None
    return out


def run_netem(args: argparse.Namespace, sizes: list[int], env: dict[str, str]) -> int:
    try:
        check_available()
    except NetemUnavailable as e:
        print(f"gradwire bench --netem: {e}", file=sys.stderr)
        return 2
    if args.train:
        return run_train(args, env)
    results: list[list[Record]] = []
    for topo in parse_configs(args.configs):
        # gradwire's own choices (tuning.py) unless --hand-tuned asks for the settings hand-tuning found
        chosen = (topo.tuning() if args.hand_tuned else {}) | env
        records = run_config(topo, sizes, args.repeats, args.warmup, chosen, links_dir=args.links)
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
        _write_docs(args.write_docs, text, args.plot, env, args.section, args.hand_tuned)
    return 0


def train_ways(args: argparse.Namespace) -> tuple[str, ...]:
    """The ways `--train` runs: its set's (plain, `--compression`'s or `--keras`'s), or those `--ways` names with their
    peer; the opt-in ways only where named."""
    ways = COMPRESSION_WAYS if args.compression else KERAS_WAYS if args.keras else TRAIN_WAYS
    if not args.ways:
        return ways
    ways += OPT_IN_WAYS if ways == TRAIN_WAYS else ()
    asked = set(args.ways.split(","))
    unknown = sorted(asked - set(ways))
    if unknown:
        raise SystemExit(f"--ways: no such way here: {unknown} (these are: {', '.join(ways)})")
    return tuple(w for w in ways if w in asked or w in PEERS)


def run_train(args: argparse.Namespace, env: dict[str, str]) -> int:
    """`--netem --train`: end-to-end training against DDP over gloo, per configuration (default: n = 4, k = 4,
    100 Mbit/s)."""
    configs = parse_configs(args.configs) if args.configs else [Topology(4, 4, "100mbit", "100mbit")]
    every = []
    for topo in configs:
        drift = tuple(args.drift.split(":", 1)) if args.drift else None
        settle = args.settle if drift else 0
        chosen = (topo.tuning() if args.hand_tuned else {}) | env | {"GRADWIRE_BENCH_MODEL": args.train_model}
        ways = train_ways(args)
        results = run_train_config(topo, args.steps, args.warmup, chosen, drift=drift, settle=settle, ways=ways)  # type: ignore[arg-type]
        every += results
        for r in results:
            if args.json:
                print(json.dumps(r), flush=True)
        if not args.json:
            print(train_table(results), flush=True)
            for r in results:
                if r.get("derived_again"):
                    steps = ", ".join(map(str, r.get("recut_steps") or [])) or "none"
                    print(
                        f"{r['way']}: settings derived again: {r['derived_again']}; re-cut in step {steps} "
                        f"(timed from step {args.warmup + settle})",
                        flush=True,
                    )
    if not args.json and len(configs) > 1:
        print("\n" + train_table(every))
    return 0


def _tuning(workers: int) -> str:
    t = Topology(workers, workers).tuning()
    return (
        f"{int(t['GRADWIRE_PARTITION_BYTES']) // 1024} KiB partitions, window {t['GRADWIRE_WINDOW']}, at most "
        f"{t['GRADWIRE_UNANSWERED']} unanswered per server"
    )


def _write_docs(
    path: str, text: str, plot_path: str | None, env: dict[str, str], name: str = "netem", hand_tuned: bool = False
) -> None:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    command = "sudo .venv/bin/gradwire " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    overrides = ", ".join(f"{k}={v}" for k, v in sorted(env.items()))
    chosen = (
        f"per configuration Topology.tuning(): {_tuning(4)} below 8 workers; {_tuning(8)} from 8 workers"
        if hand_tuned
        else "gradwire's own, derived from the links it measured at start-up (no GRADWIRE_* tuning set)"
    )
    settings = (("overrides " + overrides + "; otherwise ") if overrides else "") + chosen
    settings += " (the partition, window column)"
    section = (
        f"{begin}\n```bash\n{command}\n```\nMeasured {datetime.date.today()}, gradwire settings: {settings}.\n\n"
        f"{text}\n" + ("\n![time against n](netem.png)\n" if plot_path else "") + f"{end}"
    )
    with open(path) as f:
        doc = f.read()
    if begin in doc:
        doc = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: section, doc, flags=re.S)
    else:
        doc = doc.rstrip() + f"\n\n## {HEADINGS.get(name, name)}\n\n" + section + "\n"
    with open(path, "w") as f:
        f.write(doc)
