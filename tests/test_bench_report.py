"""How benchmarks write docs/benchmarks.md: `make bench` (bench/run_all.py) regenerates the sections of the
benchmarks it runs and keeps the hand-run ones (the soak, speculation in the latency lab); a section is replaced
in place by name; bench_wan's table puts every row next to its estimate."""
from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from load_report import write_section  # noqa: E402
from run_all import kept_sections  # noqa: E402

DOC = """# Benchmarks

Run on an earlier day.

## bench_chain
| a | 1 |

## bench_speculative in the latency lab
by hand: 4.3x

## bench_speculative
| generated | 2 |

## bench_soak (by hand: 30 minutes)
1769 served
"""


def test_make_bench_keeps_the_hand_run_sections(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    kept = kept_sections(doc, {"bench_chain", "bench_speculative", "bench_soak"})
    assert kept == ["## bench_speculative in the latency lab", "by hand: 4.3x", "",
                    "## bench_soak (by hand: 30 minutes)", "1769 served"]
    assert kept_sections(tmp_path / "missing.md", {"bench_chain"}) == []


def test_a_section_is_replaced_in_place(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    write_section(doc, "bench_speculative", ["| generated | 3 |", ""])
    text = doc.read_text()
    assert "| generated | 3 |" in text and "| generated | 2 |" not in text
    assert text.index("## bench_speculative\n") < text.index("## bench_soak")  # same place
    assert "by hand: 4.3x" in text
    write_section(doc, "bench_wan", ["new"])
    assert doc.read_text().rstrip().endswith("## bench_wan\nnew")


def test_bench_wan_rows_sit_next_to_their_estimate():
    import bench_wan

    row = {"tokens_per_s": 7.32, "ms_per_token": 136.8, "ttft_ms": 252.0, "compute_ms_per_token": 61.1,
           "hops_per_token": 3.03, "est_hops": 3, "est_ms_per_token": 136.1, "est_tokens_per_s": 7.35}
    lines = bench_wan.markdown({"tokens_per_generation": 16, "rows": {"2_servers/25ms/push/1_sessions": row}})
    assert "| 2 | 25 | push | 1 | 7.32 | 136.8 | 136.1 (3) | 1.01 | 252.0 | 61.1 | 3.03 |" in lines
