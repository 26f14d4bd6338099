"""dasktf in a Jupyter notebook, as a user runs one: a real kernel (nbclient).

The progress display must not warn. ``tqdm.auto`` in a kernel without ipywidgets
warns ``TqdmWarning: IProgress not found`` before drawing the text bar (issue 36);
dasktf asks first, and draws the text bar quietly.
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CELLS = [
    """\
import numpy as np
import keras
import dasktf
from distributed import Client

client = Client({address!r})""",
    """\
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = (x.sum(axis=1) > 0).astype("int64")
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.Dense(2, activation="softmax")])
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
history = dasktf.fit(model, x, y, epochs=2, batch_size=64, verbose=1, client=client)""",
    "client.close()",
]


def _outputs(nb) -> str:
    """Every output the cells left: streams, results, errors, as text."""
    texts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", ""))
            texts.append(str(out.get("data", {}).get("text/plain", "")))
            texts.append(" ".join([out.get("ename", ""), out.get("evalue", "")]))
    return "\n".join(texts)


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_fit_in_a_notebook_shows_progress_without_a_warning(cluster):
    if importlib.util.find_spec("ipykernel") is None:
        pytest.skip("no ipykernel: no kernel to run the notebook in")
    with_widgets = importlib.util.find_spec("ipywidgets") is not None
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(source.format(address=cluster.scheduler_address))
        for source in CELLS])
    runner = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": REPO}})
    runner.execute()  # raises CellExecutionError with the cell's traceback
    text = _outputs(nb)
    assert "TqdmWarning" not in text and "IProgress" not in text, text[-3000:]
    # the progress was shown: each epoch's summary line, after its bar
    assert "epoch 1/2" in text and "epoch 2/2" in text, text[-3000:]
    if not with_widgets:  # the text bar, on stderr: "epoch 1/2:  25%|██▌    | 1/4 [..."
        assert re.search(r"epoch 1/2: +\d+%\|.*\| \d/4 \[", text), text[-3000:]
