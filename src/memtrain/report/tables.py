"""Comparison tables from bench rows: pure functions from result dicts to text."""

from __future__ import annotations

import csv
import io
import re
import unicodedata
from typing import Any, Callable, Optional

from memtrain.config.run import DEFAULT_MODULE_TOP, ConfigError, TechniqueConfig, build_config
from memtrain.config.train_flags import dormant_settings
from memtrain.files.bench_record import UnrunBench
from memtrain.report.by_module import is_module_table, module_markdown
from memtrain.report.labels import ANSWERS_PPL_NOTE, OPTIM_NAMES, answers_only, hardware_text, method_cell, ppl_header
from memtrain.report.noise import noise_markdown
from memtrain.report.recommend import max_batch_capped, recommendation, zero_categories, zero_notes
from memtrain.techniques.facts import MEMORY_CATEGORIES

GIB = 2**30
MIB = 2**20
CATEGORIES = MEMORY_CATEGORIES  # a result's memory.by_category keys, in table order
# Rows drawn per plot. A bar per row needs ~66 pixels of height (Agg refuses images past 2**16
# pixels, about 1,000 bars), and placing labels without overlap costs quadratic time in the
# points: beyond a few dozen rows a plot is unreadable anyway, while the tables list every row.
MAX_PLOT_ROWS = 40


# --------------------------------------------------------------------------- text from results files
# A results.jsonl line may come from anywhere (a shared folder, a hand edit): every string in it
# is shown as text, never as Markdown, HTML or a spreadsheet formula.
_MD_SPECIAL = re.compile(r"([\\`|\[\]])")  # code spans, table cells, links: backslash-escaped
_HTML = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}  # tags and entities: shown as characters, never parsed
_LINE_BREAKS = {"\u2028", "\u2029"}


def _one_line(text: str) -> str:
    """``text`` without control characters (newlines, tabs, terminal escapes): each is a space."""
    return "".join(" " if unicodedata.category(c) == "Cc" or c in _LINE_BREAKS else c for c in text)


def md_text(value: Any) -> str:
    """``value`` as literal Markdown text on one line: ``| ` [ ] \\`` are backslash-escaped and
    ``& < >`` written as HTML entities."""
    text = _MD_SPECIAL.sub(r"\\\1", _one_line(str(value)))
    return "".join(_HTML.get(c, c) for c in text)


def md_code(value: Any) -> str:
    """``value`` as a Markdown code span on one line, fenced by more backticks than it holds in a row."""
    text = _one_line(str(value))
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def markdown_safe(value: Any) -> Any:
    """``value`` with every string in it (through dicts and lists) made :func:`md_text`."""
    if isinstance(value, str):
        return md_text(value)
    if isinstance(value, dict):
        return {k: markdown_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [markdown_safe(v) for v in value]
    return value


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: Any) -> Any:
    """A text cell a spreadsheet would run as a formula (``=``, ``+``, ``-``, ``@`` first) gets a
    leading ``'``; numbers stay numbers."""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def _get(row: dict[str, Any], *path: str) -> Any:
    cur: Any = row
    for key in path:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(key)
    return cur


def estimate_peak(row: dict[str, Any]) -> Optional[float]:
    est = row.get("estimate")
    if isinstance(est, dict):
        return est.get("peak_bytes")
    return None


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat record per bench row with every column's raw value (None when unknown)."""
    out = []
    for r in rows:
        ok = r.get("status") == "ok"
        peak = _get(r, "memory", "peak_bytes") if ok else None
        est = estimate_peak(r) if ok else None
        rec: dict[str, Any] = {
            "technique": r.get("technique"),
            "method": r.get("description") or r.get("technique"),
            "status": r.get("status"),
            "max_batch": _get(r, "max_batch", "batch_size"),
            "max_batch_budget_bytes": _get(r, "max_batch", "budget_bytes"),
            "max_batch_capped": max_batch_capped(r),  # the search's cap, not memory, stopped it
            "batch_size": _get(r, "config", "train", "batch_size"),
            "peak_tracked_bytes": peak,
            "peak_allocated_bytes": _get(r, "memory", "max_allocated_bytes") if ok else None,
            "peak_reserved_bytes": _get(r, "memory", "max_reserved_bytes") if ok else None,
            "step_time_s": _get(r, "step_time_s", "median") if ok else None,
            "step_time_p10_s": _get(r, "step_time_s", "p10") if ok else None,
            "step_time_p90_s": _get(r, "step_time_s", "p90") if ok else None,
            "total_time_s": r.get("total_time_s") if ok else None,  # of the `steps` training steps
            "steps": _get(r, "config", "train", "steps") if ok else None,
            "seq_len": _get(r, "config", "train", "seq_len"),
            "scale": r.get("scale"),
            "tokens_per_s": r.get("tokens_per_s") if ok else None,
            "mfu": r.get("mfu") if ok else None,
            "mfu_reference": _get(r, "mfu_reference", "kind") if ok else None,
            "val_ppl": r.get("val_ppl") if ok else None,
            "estimate_peak_bytes": est,
            "estimate_error": (est - peak) / peak if (est and peak) else None,
            "error": r.get("error"),
            "peak_phase": _get(r, "memory", "peak_phase") if ok else None,
            "precision": _get(r, "config", "technique", "precision"),
            "substituted_from": _get(r, "substituted", "from"),
            "optim_substituted_to": _get(r, "substituted_optim", "to"),
            "attention_substituted_to": _get(r, "substituted_attention", "to"),
        }
        for c in CATEGORIES:
            rec[f"{c}_bytes"] = _get(r, "memory", "by_category", c) if ok else None
        # --offload-activations: the most host bytes the row's offloaded activations took.
        rec["offloaded_peak_bytes"] = _get(r, "memory", "offloaded_peak_bytes") if ok else None
        out.append(rec)
    return out


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "n/a"
    if kind == "gib":
        return f"{value / GIB:.3f}"
    if kind == "mib":
        return f"{value / MIB:.1f}"
    if kind == "s":
        return f"{value:.3f}"
    if kind == "s1":
        return f"{value:.1f}"
    if kind == "int":
        return f"{int(value):,}"
    if kind == "pct":
        return f"{value * 100:.1f}%"
    if kind == "signed_pct":
        return f"{value * 100:+.1f}%"
    if kind == "ppl":
        return f"{value:.2f}"
    return str(value)


# The wall time of a row's training steps (the seed table's "epoch" column: there one epoch was
# the run's 200 steps; a bench at another scale runs another number of steps, named in the header).
TIME_HEADER = "Time, all steps (s)"

# (header, record key, format)
COLUMNS: list[tuple[str, str, str]] = [
    ("Method", "method", "str"),
    ("Max Batch", "max_batch", "int"),
    ("Peak Memory (GiB, tracked)", "peak_tracked_bytes", "gib"),
    ("Peak Allocated (GiB, CUDA)", "peak_allocated_bytes", "gib"),
    ("Step Time (s)", "step_time_s", "s"),
    ("Step p10-p90 (s)", "step_time_p10_s", "s_range"),
    (TIME_HEADER, "total_time_s", "s1"),
    ("Tokens/s", "tokens_per_s", "int"),
    ("MFU", "mfu", "pct"),
    ("Val PPL", "val_ppl", "ppl"),
    ("Estimate (GiB)", "estimate_peak_bytes", "gib"),
    ("Est. vs tracked", "estimate_error", "signed_pct"),
]
BREAKDOWN: list[tuple[str, str, str]] = [("Method", "method", "str")] + [
    (f"{c.capitalize()} (MiB)", f"{c}_bytes", "mib") for c in CATEGORIES
] + [("Peak (MiB)", "peak_tracked_bytes", "mib")]


def time_header(rows: list[dict[str, Any]]) -> str:
    """The time column's header naming the rows' step count ("Time, 20 steps (s)") when they share one."""
    steps = {_get(r, "config", "train", "steps") for r in rows if r.get("status") == "ok"}
    return f"Time, {steps.pop()} steps (s)" if len(steps) == 1 and None not in steps else TIME_HEADER


def markdown_table(records: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |",
             "|" + "|".join("---" if k == "str" else "---:" for _, _, k in columns) + "|"]
    for rec in records:
        cells = []
        for _, key, kind in columns:
            if kind == "s_range":  # p10-p90 of the timed steps: the row's own spread
                lo, hi = rec.get("step_time_p10_s"), rec.get("step_time_p90_s")
                cells.append(f"{lo:.3f}-{hi:.3f}" if lo is not None and hi is not None else "n/a")
                continue
            if key == "method":
                cells.append(method_cell(rec))
                continue
            cell = _fmt(rec.get(key), kind)
            if key == "max_batch" and rec.get("max_batch_capped"):
                cell += "+"  # a lower bound: every probe fitted up to the search's cap
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def csv_text(records: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    if records:
        writer = csv.DictWriter(buf, fieldnames=list(records[0].keys()), lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: csv_cell(v) for k, v in rec.items()} for rec in records)
    return buf.getvalue()


def markdown_report(rows: list[dict[str, Any]], missing: list[str], header: Callable[[], str] | None = None,
                    other: Optional[list[tuple[str, list[str]]]] = None, folder: str = "DIR",
                    unrun: Optional[list[UnrunBench]] = None) -> str:
    """The whole report.md: settings, main table, memory breakdown, failures, provenance.
    Every string from the rows is shown as literal text (:func:`markdown_safe`). ``rows`` ran
    under one set of bench settings; ``other``: the other settings of the results folder
    ``folder`` with their techniques (:func:`memtrain.files.bench_store.other_settings`), named in one line;
    ``unrun``: the benches of its record that appended no row, named in one line."""
    raw_first_ok = next((r for r in rows if r.get("status") == "ok"), None)
    rows, missing = markdown_safe(rows), [md_text(m) for m in missing]
    records = table_rows(rows)
    parts = ["# memtrain bench report", ""]
    if missing:
        parts += [f"**Partial**: {len(missing)} of {len(missing) + len(rows)} techniques have no result yet "
                  f"({', '.join(missing)}).", ""]
    parts += other_settings_lines(other or [], folder)
    parts += unrun_lines(unrun or [])
    first_ok = next((r for r in rows if r.get("status") == "ok"), None)
    if first_ok is not None and raw_first_ok is not None:
        t = first_ok["config"]["train"]
        m = first_ok["config"]["model"]
        env = first_ok.get("env", {})
        spec = raw_first_ok["config"]["model"].get("model")  # a transformers --model (None: memtrain's GPT)
        named = f"{md_code(str(spec))}, " if spec else ""
        # What every row's perplexity was read on (result.json's data.val_source; rows before it have none).
        source = (raw_first_ok.get("data") or {}).get("val_source")
        read_on = f" Val PPL read on {md_code(str(source))}." if source else ""
        parts += [
            f"Model: {named}d_model {m['d_model']}, {m['n_layers']} layers, {m['n_heads']} heads, d_ff {m['d_ff']}, "
            f"vocab {m['vocab_size']}; batch {t['batch_size']} x seq {t['seq_len']}, {t['steps']} steps, "
            f"lr {t['lr']}, warm-up {t['warmup_steps']}. Data: {md_code(raw_first_ok['config']['data']['data'])}.{read_on}",
            f"Hardware: {hardware_text(env)}; torch {env.get('torch')}; memtrain commit {env.get('commit') or 'unknown'}.",
        ]
        parts += device_lines(rows) + shared_technique_lines(rows) + [""]
    header_time = time_header(rows)
    columns = [(header_time if h == TIME_HEADER else ppl_header(rows) if k == "val_ppl" else h, k, f)
               for h, k, f in COLUMNS]
    parts += [markdown_table(records, columns), ""]
    parts += substitution_lines(rows) + optim_substitution_lines(rows) + attention_substitution_lines(rows)
    parts += mfu_lines(rows)
    parts += [
        "Peak memory (tracked) is the largest total of live tensor storage during a steady-state "
        "training step, counted by memtrain's meter on every device; Peak Allocated is "
        "`torch.cuda.max_memory_allocated` over the row's whole run, its first steps and evaluation "
        "included (CUDA only). Step time is the median "
        "over the timed steps (warm-up and metered steps excluded) and Step p10-p90 their spread; "
        f"`{header_time}` is the wall time of all of the row's training steps (timing warm-up included, "
        "evaluation excluded). Max Batch is searched "
        "(grow, then bisect) against the budget named in the rows' `max_batch` records.",
        "",
    ]
    if answers_only(rows):  # the result key stays val_ppl: the header and this line say what it averages
        parts += [f"Val PPL ({ANSWERS_PPL_NOTE}) is exp of the validation loss over the answer tokens of the "
                  "validation blocks only (`--loss-on completion`): not comparable with a perplexity over every "
                  "token.", ""]
    parts += padding_lines(rows)
    if len(records) > MAX_PLOT_ROWS:
        parts += [f"The plots show the first {MAX_PLOT_ROWS} of the {len(records)} rows.", ""]
    if any(r.get("max_batch_capped") for r in records):
        parts += ["A Max Batch written N+ reached the search's upper bound without running out of the budget: "
                  "the true maximum is at least N (raise --max-batch to search further).", ""]
    hidden = zero_categories(records, CATEGORIES)
    breakdown = [c for c in BREAKDOWN if not any(c[1] == f"{h}_bytes" for h in hidden)]
    if any(r.get("offloaded_peak_bytes") for r in records):  # only where a row offloaded activations
        breakdown.append(("Offloaded to host (MiB, peak)", "offloaded_peak_bytes", "mib"))
    breakdown.append(("Peak phase", "peak_phase", "str"))
    parts += [
        "## Memory at the peak, by category",
        "",
        markdown_table(records, breakdown),
        "",
    ]
    notes = zero_notes(records, CATEGORIES, hidden)
    if notes:
        parts += notes + [""]
    parts += module_lines(rows)
    parts += noise_markdown(rows, {r["technique"]: method_cell(r) for r in records})
    failed = [r for r in records if r["status"] != "ok"]
    if failed:
        parts += ["## Rows that did not finish", ""]
        parts += [f"- {r['method']}: {r['status']}: {r['error']}" for r in failed]
        parts.append("")
    budgets = {r["max_batch_budget_bytes"] for r in records if r.get("max_batch_budget_bytes")}
    if budgets:
        parts += [f"Max-batch budget: {', '.join(f'{b / GIB:.2f} GiB' for b in sorted(budgets))} (tracked meter).", ""]
    parts += recommendation(records, rows, min(budgets) if budgets else None)
    return "\n".join(parts)


# Settings named one by one in the report's line about rows under other settings; report.json lists all.
MAX_OTHER_SETTINGS = 3


def other_settings_lines(other: list[tuple[str, list[str]]], folder: str) -> list[str]:
    """The line saying that ``folder``'s results.jsonl holds rows run under other settings, which
    the report leaves out (a table compares rows run alike), and how to report them; none when
    there are none."""
    if not other:
        return []
    count = sum(len(techniques) for _, techniques in other)
    named = "; ".join(f"{md_code(sid)} ({', '.join(md_text(t) for t in techniques)})"
                      for sid, techniques in other[:MAX_OTHER_SETTINGS])
    more = (f"; {len(other) - MAX_OTHER_SETTINGS} more (report.json lists them)"
            if len(other) > MAX_OTHER_SETTINGS else "")
    return [f"**Other settings**: results.jsonl also holds {count} row{'s' if count != 1 else ''} run under other "
            f"settings, not compared here: settings {named}{more}. "
            f"{md_code(f'memtrain report {folder} --settings ID')} reports those of settings ID.", ""]


def unrun_sentence(unrun: list[UnrunBench], code: Callable[[Any], str], text: Callable[[Any], str]) -> str:
    """One sentence naming the recorded benches that appended no row (:func:`memtrain.files.bench_record.unrun_benches`):
    each one's settings, planned rows, start and command line (the first MAX_OTHER_SETTINGS;
    report.json lists them all), and what to do. ``code``/``text``: how a value is shown (Markdown
    code span and literal text in report.md; as it is in an error line)."""
    count = len(unrun)
    named = "; ".join(f"settings {code(u.settings)} ({', '.join(text(t) for t in u.techniques)}), started "
                      f"{text(u.started)}" + (f", {code(u.command)}" if u.command else "")
                      for u in unrun[:MAX_OTHER_SETTINGS])
    more = f"; {count - MAX_OTHER_SETTINGS} more (report.json lists them)" if count > MAX_OTHER_SETTINGS else ""
    return (f"bench_record.json names {count} bench{'es' if count != 1 else ''} that appended no row to results.jsonl "
            f"(interrupted before {'their' if count != 1 else 'its'} first row finished): {named}{more}. "
            f"Run {'them' if count != 1 else 'it'} again to report {'their' if count != 1 else 'its'} rows")


def unrun_lines(unrun: list[UnrunBench]) -> list[str]:
    """report.md's line for the recorded benches that appended no row; none when there are none."""
    if not unrun:
        return []
    return [f"**Not run**: {unrun_sentence(unrun, md_code, md_text)}.", ""]


def padding_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Under --packing pad, Tokens/s counts the padded positions each step computes: a line with
    each padded row's share of padding and its real tokens/s (result.json's pad_fraction and
    real_tokens_per_s); nothing where no row padded."""
    padded = [r for r in rows if r.get("status") == "ok" and isinstance(r.get("pad_fraction"), (int, float))
              and r["pad_fraction"] > 0]
    if not padded:
        return []
    each = "; ".join(f"{r.get('description') or r.get('technique')}: {r['pad_fraction']:.1%} padding"
                     + (f", {r['real_tokens_per_s']:,.0f} real tokens/s"
                        if isinstance(r.get("real_tokens_per_s"), (int, float)) else "")
                     for r in padded)
    return [f"Tokens/s counts every computed position, padded ones included (`--packing pad`: one record per "
            f"row): {each}.", ""]


def module_lines(rows: list[dict[str, Any]]) -> list[str]:
    """"Memory at the peak, by module": the top entries of each finished row that measured them
    (``--memory-by-module``, ``memory.by_module``); nothing when no row did. ``rows`` are
    already literal Markdown text (:func:`markdown_safe`)."""
    found = [r for r in rows if r.get("status") == "ok" and is_module_table(_get(r, "memory", "by_module"))]
    if not found:
        return []
    parts = ["## Memory at the peak, by module", ""]
    for r in found:
        top = _get(r, "config", "train", "module_top")
        top = top if isinstance(top, int) and not isinstance(top, bool) and top >= 1 else DEFAULT_MODULE_TOP
        parts += module_markdown(str(r.get("description") or r.get("technique")), r["memory"]["by_module"], top)
    return parts


def _caps(rows: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    return next((r["device_caps"] for r in rows if r.get("status") == "ok" and isinstance(r.get("device_caps"), dict)
                 and r["device_caps"].get("name")), None)


def shared_technique_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The header's line of technique settings every row ran with beside the default, such as a
    ``--config`` key (``lora_rank: 4``) that a row's name ("BF16 Mixed Precision") does not
    mention; none with fewer than two rows (the one row's name says it)."""
    ok = [r for r in rows if r.get("status") == "ok" and isinstance(r.get("config", {}).get("technique"), dict)]
    if len(ok) < 2:
        return []
    configs = [r["config"]["technique"] for r in ok]
    defaults = TechniqueConfig().__dict__
    # Only what shaped every row: a setting of a technique some row leaves off (a loss chunk beside
    # rows without the chunked loss) is one of the rows' own differences, not a shared one.
    dormant = set.union(*(_dormant(r["config"]) for r in ok))
    named = set.union(*(_named_settings(r) for r in ok))  # a row's name says those
    shared = [f"{k}={v}" for k, v in configs[0].items() if k in defaults and k not in dormant | named
              and v != defaults[k] and all(c.get(k) == v for c in configs[1:])]
    return [f"Every row also ran with: {md_code(', '.join(shared))} (beside what its name says)."] if shared else []


def _named_settings(row: dict[str, Any]) -> set[str]:
    """The settings a row's technique name sets, as the bench recorded them (``named_settings``);
    none for a row of an older memtrain."""
    named = row.get("named_settings")
    return {str(k) for k in named} if isinstance(named, list) else set()


def _dormant(config: dict[str, Any]) -> set[str]:
    """The settings of a row's ``config`` that shape a technique it leaves off; none where the
    recorded config no longer builds (a row of an older memtrain)."""
    try:
        return set(dormant_settings(build_config(config)))
    except (ConfigError, TypeError):
        return set()


def device_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The header's device line: the CPU/GPU model and whether BF16 is native (with the measured
    BF16 slowdown where it is not, and the rows that ran BF16 anyway)."""
    caps = _caps(rows)
    if caps is None:
        return []
    forced = f", forced by {caps['forced']}" if caps.get("forced") else ""
    if caps.get("native_bf16"):
        line = f"Device: {caps['name']}; BF16 is native ({caps.get('bf16_reason')}{forced})."
    else:
        slow = caps.get("bf16_slowdown")
        speed = f"; a BF16 matmul measured {slow:.1f}x slower than FP32" if slow and slow > 1 else ""
        line = f"Device: {caps['name']}; **no native BF16** ({caps.get('bf16_reason')}{forced}){speed}."
        slow_rows = [str(r.get("description") or r.get("technique")) for r in rows if r.get("status") == "ok"
                     and isinstance(r.get("device_caps"), dict) and r["device_caps"].get("precision_native") is False]
        if slow_rows:
            line += f" Rows that ran a precision without a native kernel here (slow): {', '.join(slow_rows)}."
    return [line]


def substitution_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The footnote of rows marked ``[ran in FP32*]``."""
    subs = [r for r in rows if isinstance(r.get("substituted"), dict)]
    if not subs:
        return []
    pairs = sorted({(s["substituted"]["from"], s["substituted"]["to"]) for s in subs})
    what = "; ".join(f"{a.upper()} rows ran in {b.upper()}" for a, b in pairs)
    passed_over = next((s["substituted"]["fp16_passed_over"] for s in subs if s["substituted"].get("fp16_passed_over")), "")
    why = f", the faster of the native precisions here ({passed_over.replace('fp', 'FP')})" if passed_over else ""
    return [f"\\* This device has no native BF16, so in this default list {what}{why} (the technique's "
            "memory and speed effects other than precision are kept; a BF16 row's own numbers need a device "
            "with native BF16). Name a row in `--techniques` to run it in BF16 anyway.", ""]




def optim_substitution_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The footnote of rows marked ``[ran Adafactor\u2020]`` (bench/device_rows.py says why)."""
    subs = [r["substituted_optim"] for r in rows if isinstance(r.get("substituted_optim"), dict)]
    if not subs:
        return []
    pairs = sorted({(OPTIM_NAMES.get(s["from"], s["from"]), OPTIM_NAMES.get(s["to"], s["to"])) for s in subs})
    what = "; ".join(f"{a} rows ran {b}" for a, b in pairs)
    where = subs[0].get("where", "On this CPU")
    todo = ("Name the row in `--techniques` to run torchao's optimizer." if where == "On this CPU" else
            "Install `memtrain[lowbit]` to run torchao's optimizer.")
    return [f"\u2020 {where}, in this default list, {what} ({subs[0].get('reason', '')}); the row still "
            f"shows the lowest memory, Adafactor's factored state being smaller still. {todo}", ""]


def attention_substitution_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The footnote of rows marked ``[ran mem-efficient attention\u2021]`` (bench/device_rows.py)."""
    subs = [r["substituted_attention"] for r in rows if isinstance(r.get("substituted_attention"), dict)]
    if not subs:
        return []
    kernels = ", ".join(sorted({str(s.get("to")) for s in subs}))
    return [f"\u2021 On this GPU, in this default list, windowed flash rows ran the {kernels} kernel "
            f"({subs[0].get('reason', '')}); the window and dropout are kept. Name the row in `--techniques` "
            "to run it as written.", ""]


def mfu_lines(rows: list[dict[str, Any]]) -> list[str]:
    """What the MFU column is measured against: the CPU rows' measured GEMM rates in one line
    (each row measures its own right after its steps, so they differ with the machine's load),
    one line per datasheet peak."""
    measured: dict[tuple[Any, Any], list[float]] = {}
    peaks: dict[tuple[Any, Any, Any], bool] = {}
    for r in rows:
        ref = r.get("mfu_reference") if r.get("status") == "ok" else None
        if not (isinstance(ref, dict) and ref.get("flops_per_s")):
            continue
        if ref.get("kind") == "measured_gemm":
            measured.setdefault((ref.get("name"), ref.get("measured")), []).append(float(ref["flops_per_s"]))
        else:
            peaks.setdefault((ref.get("name"), ref.get("flops_per_s"), ref.get("dtype")), True)
    out = []
    for (name, when), rates in measured.items():
        lo, hi = min(rates) / 1e9, max(rates) / 1e9
        rate = f"{lo:.1f} GFLOP/s" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f} GFLOP/s across rows"
        out.append(f"MFU (CPU rows) is against the measured GEMM rate, not a datasheet peak: {name}, {rate}"
                   + (f", {when}" if when else "") + " (`memtrain info`).")
    for name, rate, dtype in peaks:
        what = f"{str(dtype).upper()} rows" if dtype else "CUDA rows"
        out.append(f"MFU ({what}) is against the datasheet peak of {name}: {rate / 1e12:.1f} TFLOP/s.")
    return out + ([""] if out else [])
