"""Run the whole benchmark suite: print Markdown tables, write bench/RESULTS.md and bench/results.png.

    python -m bench.run            # default sizes (scaled to finish in well under an hour on 2 busy cores)
    python -m bench.run --quick    # smaller sizes, a few minutes: a check that everything runs
    python -m bench.run --full     # issue 6's full throughput workload (long on a CPU)
    python -m bench.run --only throughput concurrency --dtype float32

Each section can also be run alone: `python -m bench.throughput --help`, and so on.
"""

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench import chart
from bench.common import Section, configure_threads, cpu_description, header

HERE = Path(__file__).resolve().parent
DEFAULT_THREADS = 1  # see THREADS_NOTE


def plan(args) -> list[tuple[str, Callable[[], Section]]]:
    """(name, thunk) per section, in report order; imports are lazy so --only stays light."""
    from bench import concurrency, multiturn, sharing, soak, step_overhead, throughput, ui_overhead

    size = "full" if args.full else "quick" if args.quick else "default"
    quick = args.quick
    jobs: list[tuple[str, Callable[[], Section]]] = []
    for dtype in args.dtype:
        jobs.append(("throughput", lambda d=dtype: throughput.mix_section(args.model, d, size, args.repeats)))
        jobs.append(("issue2", lambda d=dtype: throughput.issue2_section(args.model, d, size, args.repeats)))
    jobs.append(("concurrency", lambda: concurrency.concurrency_section(args.model, args.kv_dtype,
                                                                       128 if quick else 256)))
    for dtype in args.other_dtype:
        jobs.append(("multiturn", lambda d=dtype: multiturn.multiturn_section(args.model, d, 10, 4 if quick else 16)))
    for dtype in args.other_dtype:
        jobs.append(("ui", lambda d=dtype: ui_overhead.ui_overhead_section(
            args.model, d, 2 if quick else 4, 12 if quick else 48, 1 if quick else 5)))
    for dtype in args.other_dtype:
        jobs.append(("steps", lambda d=dtype: step_overhead.step_overhead_section(
            args.model, d, (1, 32), 3 if quick else 10, 64 if quick else 128)))
    jobs.append(("sharing", lambda: sharing.sharing_section(args.model, args.kv_dtype)))
    jobs.append(("soak", lambda: soak.soak_section(steps=300 if quick else 2000)))  # its own tiny model: see soak.py
    return [(name, job) for name, job in jobs if not args.only or name in args.only]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: the default model)")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="small sizes: minutes")
    sizes.add_argument("--full", action="store_true", help="issue 6's full throughput workload")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"],
                        help="dtypes of the throughput sections (bfloat16 as issues 2 and 6 ask; float32, the dtype of the "
                             "token-for-token equality tests)")
    parser.add_argument("--other-dtype", nargs="+", default=["float32"],
                        help="dtypes of the multi-turn, UI and step sections (default: float32)")
    parser.add_argument("--kv-dtype", default="bfloat16",
                        help="dtype that sizes the KV budget of the concurrency and sharing sections")
    parser.add_argument("--only", nargs="+", choices=("throughput", "issue2", "concurrency", "multiturn", "ui",
                                                      "steps", "sharing", "soak"))
    parser.add_argument("--repeats", type=int, default=1, help="throughput rounds; each peer's best time counts")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="torch threads (default 1)")
    parser.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--chart", type=Path, default=HERE / "results.png",
                        help="the PNG; its numbers go beside it as .json (redraw: python -m bench.chart FILE.json)")
    args = parser.parse_args(argv)

    threads = configure_threads(args.threads)
    size = "full (issue 6's sizes)" if args.full else "quick" if args.quick else "default (scaled down, see each section)"
    settings = {
        "model": args.model or "default (SmolLM2-135M-Instruct, converted from the packaged GGUF)",
        "dtypes": f"throughput {', '.join(args.dtype)}; multi-turn, UI, steps {', '.join(args.other_dtype)}; "
                  f"KV budget {args.kv_dtype}",
        "torch threads": f"{threads} (`--threads`): on these 2 shared cores, 2 OpenMP threads ran F.linear 2-5x "
                         "slower than 1 while other jobs were busy",
        "sizes": size,
        "command": "python -m bench.run " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    top = header(settings)
    print(top, flush=True)
    sections: list[Section] = []
    started = time.perf_counter()
    for name, job in plan(args):
        section = job()
        sections.append(section)
        print(section.markdown(), flush=True)
        write(args.output, top, sections, time.perf_counter() - started)  # after each: a late failure keeps the rest
    ratios = {label: value for s in sections for label, value in s.chart.items()}
    cpu = cpu_description()
    subtitle = f"{cpu['cpu']}, {cpu['cores']} cores ({cpu['flags']}), torch threads {threads}, {size.split(' ')[0]} sizes"
    args.chart.with_suffix(".json").write_text(json.dumps({"subtitle": subtitle, "ratios": ratios}, indent=1))
    if ratios and chart.draw(ratios, args.chart, subtitle):
        print(f"chart: {args.chart}")


def write(path: Path, top: str, sections: list[Section], seconds: float) -> None:
    body = "\n".join(s.markdown() for s in sections)
    path.write_text(f"{top}\n{body}\n_suite: {seconds / 60:.1f} min_\n")


if __name__ == "__main__":
    main()
