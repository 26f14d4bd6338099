"""The dashboard's charts: one class each, fed by :meth:`MetricsStore.fetch` snapshots.

Every component has ``root`` (the Bokeh model to lay out), its named
``ColumnDataSource`` (s) and ``update(snapshot)``, which applies one snapshot from
the scheduler's store: only the new rows when the store says so (``source.stream``),
the whole series after the store merged pairs (``reset``). Components know nothing
about how snapshots arrive, so they are built and tested from plain dicts.

Source names are a public interface (tests and users' scripts find them with
``doc.get_model_by_name``): ``loss``, ``epochs``, ``staleness``,
``staleness_histogram``, ``workers``, and with rounds of local steps ``inner_loss``
and ``rounds``.
"""

from __future__ import annotations

import html
from typing import Any

from bokeh.layouts import column, row
from bokeh.models import (
    ColumnDataSource,
    DataTable,
    Div,
    HoverTool,
    NumberFormatter,
    TableColumn,
)
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

Snapshot = dict[str, Any]

_STATE_COLORS = {"running": "#2ca02c", "slow": "#ff7f0e", "lost": "#d62728",
                 "failed": "#d62728", "finished": "#1f77b4", "starting": "#7f7f7f"}


def worker_color(index: int) -> str:
    return Category10_10[int(index) % len(Category10_10)]


def _apply_series(source: ColumnDataSource, part: dict[str, Any] | None,
                  extra: dict[str, Any] | None = None) -> None:
    """Apply one series diff from the store to ``source``."""
    if not part:
        return
    data = {k: list(v) for k, v in part["data"].items()}
    n = len(next(iter(data.values()), []))
    for key, value in (extra or {}).items():
        data[key] = [value] * n
    if part.get("reset"):
        source.data = data
    elif n:
        source.stream(data)


def _apply_per_worker(source: ColumnDataSource, parts: dict[str, Any]) -> None:
    """Apply every worker's series diff to one source with ``worker`` and ``color``
    columns (the store resends every worker's series when any was downsampled)."""
    if any(p.get("reset") for p in parts.values()):
        merged: dict[str, list[Any]] = {k: [] for k in source.data}
        for w, p in sorted(parts.items(), key=lambda kv: int(kv[0])):
            n = len(next(iter(p["data"].values()), []))
            for key, values in p["data"].items():
                merged[key] += list(values)
            merged["worker"] += [w] * n
            merged["color"] += [worker_color(int(w))] * n
        source.data = merged
    else:
        for w, p in parts.items():
            _apply_series(source, p, {"worker": w, "color": worker_color(int(w))})


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s" if m else f"{s}s"


class RunHeader:
    """Mode, model, workers, epoch progress and the estimated time left."""

    def __init__(self) -> None:
        self.root = Div(name="header", text="<b>dasktf</b>: waiting for a run...",
                        sizing_mode="stretch_width")

    def update(self, snapshot: Snapshot) -> None:
        if snapshot.get("run") is None:
            self.root.text = (
                f"<b>dasktf</b>: {html.escape(str(snapshot.get('error', 'no run yet')))}"
            )
            return
        h = snapshot["header"]
        total = h.get("total_updates")
        progress = f"{h['updates']:,}" + (f" / {total:,}" if total else "")
        status = html.escape(str(h.get("status")))
        color = _STATE_COLORS.get(h.get("status", ""), "#000")
        parts = [
            f"<b>run</b> {html.escape(str(h['run']))}",
            f"<b>mode</b> <span class='mode'>{html.escape(str(h.get('mode') or '?'))}</span>",
            f"<b>engine</b> <span class='engine'>"
            f"{html.escape(str(h.get('engine') or '?'))}</span>",
            f"<b>model</b> {html.escape(str(h.get('model') or '?'))}",
            f"<b>workers</b> {h.get('n_workers')} ({', '.join(h.get('devices') or []) or '?'})",
            f"<b>epoch</b> {h.get('epoch')} / {h.get('epochs') or '?'}",
            f"<b>updates</b> {progress} ({h.get('updates_per_s', 0):.1f}/s)",
            f"<b>elapsed</b> {format_seconds(h.get('elapsed_s'))}",
            f"<b>time left</b> {format_seconds(h.get('eta_s'))}",
            f"<b>status</b> <span style='color:{color}'>{status}</span>",
        ]
        text = " &nbsp;·&nbsp; ".join(parts)
        if h.get("error"):
            text += f"<br><span style='color:#d62728'>{html.escape(str(h['error']))}</span>"
        self.root.text = f"<div class='dasktf-header' style='font-size:14px'>{text}</div>"


class LossCurves:
    """Training loss per update (live) and epoch-end train/validation loss and accuracy."""

    def __init__(self, height: int = 300) -> None:
        self.loss = ColumnDataSource({"update": [], "loss": []}, name="loss")
        self.epochs = ColumnDataSource(
            {k: [] for k in ("epoch", "update", "loss", "accuracy", "val_loss",
                             "val_accuracy", "examples_per_sec")},
            name="epochs",
        )
        self.loss_figure = figure(
            title="Loss", x_axis_label="update", y_axis_label="loss", height=height,
            sizing_mode="stretch_width", tools="pan,wheel_zoom,box_zoom,reset,save",
            output_backend="webgl",
        )
        self.loss_figure.line("update", "loss", source=self.loss, legend_label="train (step)",
                              color="#1f77b4", line_width=1.5)
        self.loss_figure.scatter("update", "loss", source=self.epochs, size=8,
                                 legend_label="train (epoch)", color="#1f77b4", marker="square")
        self.loss_figure.line("update", "val_loss", source=self.epochs, color="#d62728",
                              legend_label="validation", line_width=2)
        self.loss_figure.scatter("update", "val_loss", source=self.epochs, size=8,
                                 color="#d62728")
        self.loss_figure.legend.location = "top_right"
        self.loss_figure.add_tools(HoverTool(tooltips=[("update", "@update"),
                                                       ("loss", "@loss{0.0000}")]))
        self.accuracy_figure = figure(
            title="Accuracy (epoch ends)", x_axis_label="update", y_axis_label="accuracy",
            height=height, sizing_mode="stretch_width", tools="pan,wheel_zoom,reset,save",
            x_range=self.loss_figure.x_range,
        )
        for col, color, label in (("accuracy", "#1f77b4", "train"),
                                  ("val_accuracy", "#d62728", "validation")):
            self.accuracy_figure.line("update", col, source=self.epochs, color=color,
                                      legend_label=label, line_width=2)
            self.accuracy_figure.scatter("update", col, source=self.epochs, color=color,
                                         size=8)
        self.accuracy_figure.legend.location = "bottom_right"
        self.root = row(self.loss_figure, self.accuracy_figure, sizing_mode="stretch_width")

    def update(self, snapshot: Snapshot) -> None:
        series = snapshot.get("series") or {}
        _apply_series(self.loss, series.get("loss"))
        _apply_series(self.epochs, series.get("epochs"))
        stride = (series.get("loss") or {}).get("stride", 1)
        self.loss_figure.title.text = (
            "Loss" if stride == 1 else f"Loss (each point: mean of {stride} steps)"
        )


class StalenessPanel:
    """Staleness over time per worker and its histogram; says so in sync mode."""

    SYNC_NOTE = (
        "sync mode: every worker applies the same summed gradient to the weights it "
        "was computed on, so staleness is 0 for every update."
    )

    def __init__(self, height: int = 260) -> None:
        self.source = ColumnDataSource(
            {"update": [], "staleness": [], "worker": [], "color": []}, name="staleness"
        )
        self.histogram = ColumnDataSource(
            {"staleness": [], "count": [], "left": [], "right": []},
            name="staleness_histogram",
        )
        self.note = Div(name="staleness_note", text="", sizing_mode="stretch_width")
        self.over_time = figure(
            title="Staleness per update, by worker", x_axis_label="update",
            y_axis_label="staleness (updates)", height=height,
            sizing_mode="stretch_width", tools="pan,wheel_zoom,box_zoom,reset,save",
            output_backend="webgl",
        )
        self.over_time.scatter("update", "staleness", source=self.source, color="color",
                               size=4, alpha=0.6)
        self.over_time.add_tools(HoverTool(tooltips=[("worker", "@worker"),
                                                     ("update", "@update"),
                                                     ("staleness", "@staleness")]))
        self.hist_figure = figure(
            title="Staleness histogram", x_axis_label="staleness (updates)",
            y_axis_label="updates", height=height, sizing_mode="stretch_width",
            tools="save",
        )
        self.hist_figure.quad(left="left", right="right", top="count", bottom=0,
                              source=self.histogram, color="#9467bd", alpha=0.8)
        self.root = column(self.note, row(self.over_time, self.hist_figure,
                                          sizing_mode="stretch_width"),
                           sizing_mode="stretch_width")

    ROUNDS_NOTE = (
        "sync mode, rounds of {h} local steps: every round starts all workers from the "
        "same averaged weights, so staleness is 0 for every update (a round); within "
        "a round the replicas drift apart instead (see Rounds below)."
    )

    def update(self, snapshot: Snapshot) -> None:
        mode = (snapshot.get("header") or {}).get("mode", "")
        h = int((snapshot.get("meta") or {}).get("local_steps") or 1)
        unit = "its round's change" if h > 1 else "its gradient"
        self.note.text = (
            f"<i>{self.ROUNDS_NOTE.format(h=h) if h > 1 else self.SYNC_NOTE}</i>"
            if mode == "sync" else
            f"<i>{mode} mode: staleness = updates applied between a worker reading the "
            f"weights and {unit} being applied.</i>" if mode else ""
        )
        _apply_per_worker(self.source, (snapshot.get("series") or {}).get("staleness") or {})
        hist = snapshot.get("histogram") or {}
        values = list(hist.get("staleness") or [])
        self.histogram.data = {
            "staleness": values, "count": list(hist.get("count") or []),
            "left": [v - 0.4 for v in values], "right": [v + 0.4 for v in values],
        }


class RoundsPanel:
    """Rounds of local steps: each worker's inner-step loss with the round
    boundaries, and per round the drift and the bytes moved per example. Hidden
    unless the run trains in rounds (``local_steps`` > 1)."""

    NOTE = (
        "Rounds of {h} local steps: each worker takes {h} steps on its own batches, "
        "then the workers' changes are averaged (dashed lines: round ends). Drift = the "
        "workers' spread around the mean change over its norm: how far the replicas "
        "wandered apart in the round."
    )

    def __init__(self, height: int = 260) -> None:
        self.inner = ColumnDataSource({"step": [], "loss": [], "worker": [], "color": []},
                                      name="inner_loss")
        self.rounds = ColumnDataSource(
            {"round": [], "step": [], "drift": [], "bytes_per_example": []}, name="rounds")
        self.note = Div(name="rounds_note", text="", sizing_mode="stretch_width")
        tools = "pan,wheel_zoom,box_zoom,reset,save"
        self.loss_figure = figure(
            title="Inner-step loss per worker", x_axis_label="step", y_axis_label="loss",
            height=height, sizing_mode="stretch_width", tools=tools, output_backend="webgl")
        self.loss_figure.vspan(x="step", source=self.rounds, line_color="#7f7f7f",
                               line_dash="dashed", line_alpha=0.5)
        self.loss_figure.scatter("step", "loss", source=self.inner, color="color", size=3,
                                 alpha=0.6)
        self.loss_figure.add_tools(HoverTool(tooltips=[("worker", "@worker"),
                                                       ("step", "@step"),
                                                       ("loss", "@loss{0.0000}")]))
        self.drift_figure = figure(
            title="Drift per round", x_axis_label="step", y_axis_label="drift",
            height=height, sizing_mode="stretch_width", tools=tools,
            x_range=self.loss_figure.x_range)
        self.drift_figure.line("step", "drift", source=self.rounds, color="#ff7f0e",
                               line_width=2)
        self.drift_figure.scatter("step", "drift", source=self.rounds, color="#ff7f0e",
                                  size=5)
        self.bytes_figure = figure(
            title="Bytes moved per example (run so far)", x_axis_label="step",
            y_axis_label="bytes / example", height=height, sizing_mode="stretch_width",
            tools=tools, x_range=self.loss_figure.x_range)
        self.bytes_figure.line("step", "bytes_per_example", source=self.rounds,
                               color="#2ca02c", line_width=2)
        self.root = column(
            Div(text="<h3 style='margin:4px 0'>Rounds</h3>"), self.note,
            row(self.loss_figure, self.drift_figure, self.bytes_figure,
                sizing_mode="stretch_width"),
            sizing_mode="stretch_width", visible=False, name="rounds_panel")

    def update(self, snapshot: Snapshot) -> None:
        h = int((snapshot.get("meta") or {}).get("local_steps") or 1)
        self.root.visible = h > 1
        if h <= 1:
            return
        self.note.text = f"<i>{self.NOTE.format(h=h)}</i>"
        series = snapshot.get("series") or {}
        _apply_per_worker(self.inner, series.get("inner") or {})
        _apply_series(self.rounds, series.get("rounds"))


class WorkerPanel:
    """The worker table, per-worker examples/s and the step-time breakdown."""

    COLUMNS = (
        ("worker", "#", None), ("address", "address", None), ("device", "device", None),
        ("shard_size", "shard size", "0,0"), ("steps", "steps done", "0,0"),
        ("last_update", "last update", "0,0"), ("state", "state", None),
        ("examples_per_s", "examples/s", "0,0"), ("compute_ms", "compute ms", "0.0"),
        ("communication_ms", "comm. ms", "0.0"), ("waiting_ms", "waiting ms", "0.0"),
        ("staleness_mean", "mean staleness", "0.00"), ("mb_moved", "MB moved", "0.0"),
    )

    def __init__(self, height: int = 220) -> None:
        self.source = ColumnDataSource({c: [] for c, _, _ in self.COLUMNS} | {"label": []},
                                       name="workers")
        self.table = DataTable(
            source=self.source, name="worker_table", index_position=None,
            sizing_mode="stretch_width", height=160,
            columns=[
                TableColumn(field=c, title=t, width=180 if c == "address" else 70,
                            **({"formatter": NumberFormatter(format=f)} if f else {}))
                for c, t, f in self.COLUMNS
            ],
        )
        self.rate_figure = figure(
            title="Examples/s per worker (recent steps)", y_range=[], height=height,
            sizing_mode="stretch_width", tools="save", x_axis_label="examples/s",
        )
        self.rate_figure.hbar(y="label", right="examples_per_s", height=0.6,
                              source=self.source, color="#2ca02c")
        self.time_figure = figure(
            title="Step time per worker: compute / communication / waiting (ms)",
            y_range=self.rate_figure.y_range, height=height, sizing_mode="stretch_width",
            tools="hover,save", x_axis_label="ms per step",
            tooltips="@label: $name @$name{0.0} ms",
        )
        self.time_figure.hbar_stack(
            ["compute_ms", "communication_ms", "waiting_ms"], y="label", height=0.6,
            source=self.source, color=["#1f77b4", "#ff7f0e", "#c7c7c7"],
            legend_label=["compute", "communication", "waiting"],
        )
        legend = self.time_figure.legend[0]
        legend.orientation = "horizontal"
        self.time_figure.add_layout(legend, "below")  # never over the bars
        self.root = column(
            self.table,
            row(self.rate_figure, self.time_figure, sizing_mode="stretch_width"),
            sizing_mode="stretch_width",
        )

    def update(self, snapshot: Snapshot) -> None:
        rows = snapshot.get("workers")
        if not rows:
            return
        data = {k: list(v) for k, v in rows.items() if k in self.source.data}
        if data == dict(self.source.data):
            return
        self.source.data = data
        # BokehJS 3.9's DataTable renders a replaced ``data`` only once; a new
        # source for the table (the named one keeps feeding the charts) always shows.
        self.table.source = ColumnDataSource(dict(data))
        labels = list(data["label"])
        if list(self.rate_figure.y_range.factors) != labels:
            self.rate_figure.y_range.factors = labels
