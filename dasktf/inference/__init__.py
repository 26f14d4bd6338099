"""Inference where the data lives: :func:`~dasktf.inference.predict.predict` and
:func:`~dasktf.inference.evaluate.evaluate` (client side; the worker side is
:mod:`dasktf.runtime.inference`)."""
