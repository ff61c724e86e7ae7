"""``python -m torus.doctor DIR``: the diagnosis of a stalled or failed job from its ranks' flight records
(``torus-trace-rank*.json``, written by torus.recorder; gather them from every host into DIR first).

For each communicator (its id is the same in every rank's dump): the first call where the ranks part, and
who is where. The ranks part at the first sequence number that failed on some rank (a stall timeout: a cut
link leaves every rank waiting in the same call, each naming its peer), that some rank never entered while
another is stuck in it (the first is behind, stuck in its own code, stopped, or gone), or where ranks called
different collectives; a rank that left no dump is named too (stopped, killed, or on a host cut off). For each rank in
the parting call: where it waits (a stall timeout's step and peer), or that it finished. Prints one block per
communicator; exit status 0 when every dumped communicator is whole and agrees, 1 when a diagnosis names a
problem, 2 when DIR holds no dump.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

STUCK_S = 5.0  # a call still running this long after it started, at the dump, counts as stuck
_PEER = re.compile(r"waiting on ranks? ([\d, and]+)")


def load(folder: str | Path) -> list[dict]:
    """Every readable dump in ``folder`` (an unreadable one is skipped with a line on stderr)."""
    dumps = []
    for path in sorted(Path(folder).glob("torus-trace-rank*.json")):
        try:
            dumps.append(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            print(f"torus doctor: skipping {path}: {e}", file=sys.stderr)
    return dumps


def _call(record: dict) -> str:
    return (f"{record['op']} of {record['count']} {record['dtype']} ({record['algorithm']}, "
            f"{record['transport']}), called by {record['caller']}")


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _where(record: dict) -> str:
    """Where a rank is in a call: its stall timeout's step and peer, or its state."""
    error = record.get("error") or ""
    if record["state"] == "done":
        return "finished it"
    if record["state"] == "running":
        return "is inside it (no error yet)"
    step = re.search(r"(at step \d+/\d+|in the argument check)", error)
    peer = _PEER.search(error)
    left = re.search(r"rank (\d+) left the job", error)
    if left:
        return f"failed: rank {left.group(1)} left the job (its Python exited)"
    if "no progress for" in error:
        parts = ["timed out", step.group(1) if step else ""]
        if peer:
            peers = peer.group(1).strip()
            parts.append(f"waiting on rank{'s' if ',' in peers or 'and' in peers else ''} {peers}")
        return " ".join(p for p in parts if p)
    return f"failed: {error}"


def diagnose(dumps: list[dict], comm_id: str | None = None) -> list[str]:
    """The diagnosis as lines (one block per communicator; only ``comm_id`` where given)."""
    comms: dict = {}
    for d in dumps:
        for c in d["communicators"]:
            if comm_id is None or c["comm_id"] == comm_id:
                comms.setdefault(c["comm_id"], {})[c["rank"]] = (c, d)
    if not comms:
        return ["torus doctor: no flight record" + (f" of communicator {comm_id}" if comm_id else "")]
    lines = []
    for cid, by_rank in sorted(comms.items()):
        lines += _one(cid, by_rank)
    return lines


def _one(cid: str, by_rank: dict) -> list[str]:
    any_comm = next(iter(by_rank.values()))[0]
    size, world = any_comm["size"], any_comm["world_ranks"]
    records = {r: {rec["seq"]: rec for rec in c["records"]} for r, (c, _) in by_rank.items()}
    last = {r: c["calls"] for r, (c, _) in by_rank.items()}
    missing = [r for r in range(size) if r not in by_rank]
    head = (f"torus doctor: communicator {cid}, {size} rank{'s' if size > 1 else ''} (world ranks "
            f"{', '.join(map(str, world))}), calls up to #{max(last.values())}")
    # the first call some rank differs in: a different collective, or one a rank never entered
    dumped_at = {r: d["time"] for r, (_, d) in by_rank.items()}
    parting = None
    for seq in sorted({s for recs in records.values() for s in recs}):
        held = {r: recs[seq] for r, recs in records.items() if seq in recs}
        kinds = {(h["op"], h["count"], h["dtype"], h["algorithm"]) for h in held.values()}
        behind = [r for r in records if last[r] < seq]
        # a healthy job dumped by SIGUSR1 catches ranks a call apart: only a call running for a while, or one
        # that failed, is a parting
        failed = any(h["state"] == "failed" for h in held.values())
        stuck = failed or any(h["state"] == "running" and dumped_at[r] - h["start"] > STUCK_S
                              for r, h in held.items())
        if len(kinds) > 1 or failed or ((behind or missing) and stuck):
            parting = seq
            break
    if parting is None:
        if missing:
            return [head + ":", f"  {_ranks(missing)} left no record (stopped, killed, or on a host cut off); "
                    f"the others finished every call they recorded"]
        return [head + ": the ranks agree and every recorded call finished"]
    held = {r: recs[parting] for r, recs in records.items() if parting in recs}
    lines = [head + ":"]
    by_kind: dict = {}
    for r, h in held.items():
        by_kind.setdefault(_call(h), []).append(r)
    if len(by_kind) > 1:
        lines.append(f"  the ranks part at call #{parting}: they called different collectives:")
        lines += [f"  - {_ranks(rs)}: {what}" for what, rs in sorted(by_kind.items(), key=lambda kv: kv[1])]
    else:
        lines.append(f"  the ranks part at call #{parting}, {next(iter(by_kind))}:")
    for r in sorted(records):
        if last[r] < parting:
            prev = records[r].get(last[r])
            was = f"#{last[r]} {prev['op']}, {prev['state']}" if prev else f"#{last[r]}"
            lines.append(f"  - rank {r} never entered it: its last call is {was}")
    for r in missing:
        lines.append(f"  - rank {r} left no record (stopped, killed, blocked outside torus, or on a host cut off)")
    for r, h in sorted(held.items()):
        if len(by_kind) == 1 or h["state"] != "done":
            lines.append(f"  - rank {r} {_where(h)}")
    return lines


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m torus.doctor", description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="the folder holding the torus-trace-rank*.json dumps (TORUS_TRACE_DIR)")
    args = ap.parse_args(argv)
    dumps = load(args.folder)
    if not dumps:
        print(f"torus doctor: no torus-trace-rank*.json in {args.folder}", file=sys.stderr)
        return 2
    lines = diagnose(dumps)
    print("\n".join(lines))
    return 0 if all("agree" in ln for ln in lines if ln.startswith("torus doctor:")) else 1


if __name__ == "__main__":
    sys.exit(main())
