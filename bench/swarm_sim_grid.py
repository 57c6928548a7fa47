"""The settings sweep of the swarm simulation (`bench/bench_swarm_sim.py --grid`): runs, JSON and plots in docs/.

For swarms of 30, 100, 1,000 and 10,000 servers it runs the reference policy (baseline) and variants of
balance_quality, balance_period, update_period and the hole watch, writes every run's summary to
docs/swarm-simulation.json and draws docs/swarm-sim-timeline.png (throughput and holes over time, baseline vs
recommended) and docs/swarm-sim-settings.png (moves per hour, holes and throughput against the settings).

`run_seeds` (`--sweep`) runs the recommended settings of docs/swarm-simulation.md and their baselines over several
seeds (`SEED_SWEEP`) and reports each measure's mean, standard deviation, minimum and maximum over the seeds
(docs/swarm-simulation-seeds.json).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, List, Optional

# (servers, hours, [policy variants as overrides of the baseline])
SIZES = [
    (30, 6.0, ["baseline", "hole", "hole_u60", "hole_u30", "hole_u60_q05", "hole_u60_q09", "hole_u60_b300"]),
    (100, 4.0, ["baseline", "hole", "hole_u60", "hole_u30", "hole_u60_q05", "hole_u60_q09", "hole_u60_b300"]),
    (1000, 1.5, ["baseline", "hole_u60", "hole_u60_q05", "hole_u60_q09"]),
    (10000, 0.5, ["baseline", "hole_u60"]),
]
VARIANTS = {
    "baseline": {},
    "hole": {"hole_check_period": 5.0},
    "hole_u60": {"hole_check_period": 5.0, "update_period": 60.0},
    "hole_u30": {"hole_check_period": 5.0, "update_period": 30.0},
    "hole_u60_q05": {"hole_check_period": 5.0, "update_period": 60.0, "balance_quality": 0.5},
    "hole_u60_q09": {"hole_check_period": 5.0, "update_period": 60.0, "balance_quality": 0.9},
    "hole_u60_b300": {"hole_check_period": 5.0, "update_period": 60.0, "balance_period": 300.0},
}
RECOMMENDED = "hole_u60"
# (servers, hours, policies) of the multi-seed sweep: the recommended settings per swarm size and their baselines
SEED_SWEEP = [
    (30, 6.0, ["baseline", "hole", "hole_u60", "hole_u30"]),
    (100, 4.0, ["baseline", "hole_u60", "hole_u30"]),
    (1000, 1.5, ["baseline", "hole_u60_b300"]),
]
SPREAD_KEYS = ["bottleneck_of_ideal", "hole_block_minutes", "hole_duration_max_s", "moves_per_hour",
               "failed_first_try_dead", "sessions", "route_ms_p50"]


def spread(results: List[dict], keys: List[str] = SPREAD_KEYS) -> dict:
    """Mean, standard deviation (0 for one run), min and max of each key over runs of several seeds."""
    import statistics

    summary = {}
    for key in keys:
        values = [r[key] for r in results if r.get(key) is not None]
        if values:
            summary[key] = {"mean": round(statistics.fmean(values), 3),
                            "std": round(statistics.stdev(values), 3) if len(values) > 1 else 0.0,
                            "min": min(values), "max": max(values)}
    return summary


def run_seeds(out: Optional[str], simulate: Callable, baseline, replace: Callable, seeds: List[int],
              sweep: Optional[list] = None) -> List[dict]:
    """Each (servers, policy) of `sweep` (default `SEED_SWEEP`) once per seed; one summary per pair."""
    summaries = []
    for servers, hours, names in sweep or SEED_SWEEP:
        for name in names:
            policy = replace(baseline, name=name, **VARIANTS[name])
            runs = [simulate(policy, servers=servers, hours=hours, seed=seed) for seed in seeds]
            summary = {"servers": servers, "hours": hours, "policy": name, "seeds": list(seeds), **spread(runs)}
            print(json.dumps(summary), file=sys.stderr, flush=True)
            summaries.append(summary)
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "swarm-simulation-seeds.json").write_text(json.dumps(summaries, indent=1))
    return summaries


def run_grid(out: str, simulate: Callable, baseline, _recommended, replace: Callable) -> List[dict]:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for servers, hours, names in SIZES:
        for name in names:
            policy = replace(baseline, name=name, **VARIANTS[name])
            result = simulate(policy, servers=servers, hours=hours)
            summary = {k: v for k, v in result.items() if k != "samples"}
            print(json.dumps(summary), file=sys.stderr, flush=True)
            results.append(result)
    (out_dir / "swarm-simulation.json").write_text(json.dumps(
        [{k: v for k, v in r.items() if k != "samples"} for r in results], indent=1))
    plot(results, out_dir)
    print(json.dumps({"runs": len(results), "json": str(out_dir / "swarm-simulation.json")}))
    return results


def plot(results: List[dict], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [30, 1000]
    fig, axes = plt.subplots(2, len(sizes), figsize=(12, 6), sharex="col")
    for column, servers in enumerate(sizes):
        for r in results:
            if r["servers"] != servers or r["policy"]["name"] not in ("baseline", RECOMMENDED):
                continue
            t = [s["t_min"] for s in r["samples"]]
            label = "reference policy" if r["policy"]["name"] == "baseline" else "hole watch, update 60 s"
            axes[0][column].plot(t, [s["bottleneck"] for s in r["samples"]], label=label, lw=1)
            axes[1][column].plot(t, [s["holes"] for s in r["samples"]], label=label, lw=1)
        axes[0][column].set_title(f"{servers} servers, 80 blocks")
        axes[0][column].set_ylabel("bottleneck (steps/s)")
        axes[1][column].set_ylabel("blocks with no live server")
        axes[1][column].set_xlabel("minutes")
        axes[0][column].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "swarm-sim-timeline.png", dpi=90)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for servers, marker in ((30, "o"), (100, "s"), (1000, "^"), (10000, "x")):
        runs = [r for r in results if r["servers"] == servers]
        names = [r["policy"]["name"] for r in runs]
        axes[0].plot(names, [r["moves_per_server_hour"] for r in runs], marker=marker, label=f"{servers}")
        axes[1].plot(names, [r["hole_block_minutes"] / r["hours"] for r in runs], marker=marker, label=f"{servers}")
        axes[2].plot(names, [r["bottleneck_of_ideal"] for r in runs], marker=marker, label=f"{servers}")
    for ax, title in zip(axes, ("moves per server per hour", "hole block-minutes per hour",
                                "bottleneck / ideal throughput")):
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=45, labelsize=7)
        ax.legend(title="servers", fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "swarm-sim-settings.png", dpi=90)
    plt.close(fig)
