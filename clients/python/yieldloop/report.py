"""``yieldloop report``: a PNG of training and held-out reward per step and an HTML page around it.

Reads what the closed loop records in its run directory (``run.json``, ``steps.jsonl``,
``samples.jsonl``, ``checkpoints.json``) and writes ``report.png`` and ``report.html`` there. The page
holds the curves, the per-step time split, the checkpoint tree (promoted / unpromoted, with the reason)
and sample trajectories. No network, no server: open the file.
"""

from __future__ import annotations

import base64
import html
import json
import pathlib
from typing import Any

from yieldloop.errors import NotFoundError


def _rows(path: pathlib.Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def load_run(run_dir: pathlib.Path) -> dict[str, Any]:
    if not (run_dir / "steps.jsonl").exists():
        raise NotFoundError(f"{run_dir} is not a run directory (no steps.jsonl)", reason="RUN_NOT_FOUND")
    rows = _rows(run_dir / "steps.jsonl")
    return {
        "meta": json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").exists() else {},
        "baseline": next((r for r in rows if "promoted" not in r), None),  # the step-0 row of RunRecorder.baseline
        "steps": [r for r in rows if "promoted" in r],
        "samples": _rows(run_dir / "samples.jsonl"),
        "checkpoints": json.loads((run_dir / "checkpoints.json").read_text())
        if (run_dir / "checkpoints.json").exists()
        else [],
    }


def plot(run: dict[str, Any], path: pathlib.Path) -> pathlib.Path | None:
    """Draws the reward curves into ``path``; None when matplotlib is not installed (the ``report`` extra)."""
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = run["steps"]
    x = list(range(1, len(steps) + 1))
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot(x, [s["train_reward"] for s in steps], "o-", label="training reward (mean)")
    ax.plot(x, [s["heldout_reward"] for s in steps], "s-", label="held-out reward (candidate)")
    head = [s["head_heldout_reward"] for s in steps]
    if run["baseline"]:
        ax.plot([0, *x], [run["baseline"]["heldout_reward"], *head], "--", color="grey", label="held-out reward (HEAD)")
    rejected = [(i, s["heldout_reward"]) for i, s in zip(x, steps) if not s["promoted"]]
    if rejected:
        ax.scatter(*zip(*rejected), marker="x", color="red", s=60, zorder=3, label="not promoted")
    ax.set_xlabel("loop step (each commits one checkpoint)")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"job {run['meta'].get('job_id', '')}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _tree_html(checkpoints: list[dict[str, Any]]) -> str:
    children: dict[str, list[dict[str, Any]]] = {}
    ids = {c["checkpoint_id"] for c in checkpoints}
    for c in checkpoints:
        parent = c.get("parent_checkpoint_id", "")
        children.setdefault(parent if parent in ids else "", []).append(c)

    def node(c: dict[str, Any]) -> str:
        promotion = c.get("promotion", {})
        state = promotion.get("state", "PROMOTION_STATE_UNSPECIFIED")
        label = {"PROMOTION_STATE_PROMOTED": "promoted", "PROMOTION_STATE_REJECTED": "not promoted"}.get(state, "")
        css = {"promoted": "ok", "not promoted": "bad"}.get(label, "")
        text = f"<code>{html.escape(c['checkpoint_id'])}</code> step {c.get('step', 0)}"
        if c.get("is_head"):
            text += " <b>&#9654; HEAD</b>"
        if label:
            text += f" <span class='{css}'>{label}</span>: {html.escape(promotion.get('reason', ''))}"
        kids = "".join(node(k) for k in children.get(c["checkpoint_id"], []))
        return f"<li>{text}{f'<ul>{kids}</ul>' if kids else ''}</li>"

    return "<ul class='tree'>" + "".join(node(c) for c in children.get("", [])) + "</ul>"


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _image(png: pathlib.Path | None) -> str:
    if png is None:
        return (
            "<p>(no plot: install the client's <code>report</code> extra, "
            "<code>pip install 'yieldloop[report]'</code>)</p>"
        )
    data = base64.b64encode(png.read_bytes()).decode()
    return f'<img src="data:image/png;base64,{data}" alt="training and held-out reward">'


def write_report(run_dir: str | pathlib.Path) -> tuple[pathlib.Path | None, pathlib.Path]:
    """Writes ``report.png`` (when matplotlib is installed) and ``report.html`` into ``run_dir``; returns their
    paths (the plot's None without matplotlib)."""
    run_dir = pathlib.Path(run_dir)
    run = load_run(run_dir)
    png = plot(run, run_dir / "report.png")
    steps = run["steps"]
    step_rows = [
        [
            i,
            s["step"],
            s["checkpoint_id"],
            "yes" if s["promoted"] else "no",
            f"{s['train_reward']:.3f}",
            f"{s['heldout_reward']:.3f}",
            f"{s['kl']:.4f}",
            f"{s['clip_fraction']:.3f}",
            s["groups_without_spread"],
            f"{s['rollout_s']:.2f}",
            f"{s['forward_backward_s']:.2f}",
            f"{s['optim_s']:.2f}",
            f"{s['heldout_s']:.2f}",
            f"{s['reload_s']:.2f}",
            s.get("warning", ""),
        ]
        for i, s in enumerate(steps, 1)
    ]
    samples = [
        [
            r["step"],
            r["kind"],
            json.dumps(r["task"]),
            r["prompt"],
            r["answer"],
            f"{r['reward']:.3f}",
            r["weight_version"],
        ]
        for r in run["samples"]
        if r["step"] in {0, steps[-1]["step"] if steps else 0}
    ]
    baseline = run["baseline"]
    summary = (
        f"held-out reward {baseline['heldout_reward']:.3f} ({baseline['checkpoint_id']}) &rarr; "
        f"{steps[-1]['head_heldout_reward']:.3f} ({html.escape(steps[-1]['head_checkpoint_id'])}) in {len(steps)} steps"
        if baseline and steps
        else f"{len(steps)} steps"
    )
    config = run["meta"].get("config", {})
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>yieldloop report {html.escape(run["meta"].get("job_id", ""))}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 1200px; }}
table {{ border-collapse: collapse; font-size: 0.85em; margin-bottom: 1.5em; }}
td, th {{ border: 1px solid #ccc; padding: 2px 6px; text-align: left; }}
.ok {{ color: #080; font-weight: bold; }} .bad {{ color: #b00; font-weight: bold; }}
ul.tree, ul.tree ul {{ list-style: none; padding-left: 1.2em; border-left: 1px dotted #999; }}
</style></head><body>
<h1>yieldloop run {html.escape(run["meta"].get("job_id", ""))}</h1>
<p>{summary}. Model <code>{html.escape(str(config.get("model", "")))}</code>, training tasks
<code>{html.escape(str(config.get("train_tasks", "")))}</code>, held-out tasks
<code>{html.escape(str(config.get("heldout_tasks", "")))}</code>.</p>
<h2>Reward per step</h2>
{_image(png)}
<h2>Steps (time split in seconds)</h2>
{
        _table(
            [
                "#",
                "step",
                "checkpoint",
                "promoted",
                "train",
                "held-out",
                "KL",
                "clip frac",
                "no-spread groups",
                "rollout",
                "fwd/bwd",
                "optim+ckpt",
                "held-out eval",
                "reload",
                "warning",
            ],
            step_rows,
        )
    }
<h2>Checkpoint tree</h2>
{_tree_html(run["checkpoints"])}
<h2>Sample trajectories (first and last step)</h2>
{_table(["step", "kind", "task", "prompt", "answer", "reward", "weights"], samples)}
<h2>Config</h2>
<pre>{html.escape(json.dumps(config, indent=1))}</pre>
</body></html>
"""
    out = run_dir / "report.html"
    out.write_text(page)
    return png, out
