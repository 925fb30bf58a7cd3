"""Every public function documents each of its parameters, its returns, its errors and its source."""

import inspect
import re

import pytest

import cuflash
from cuflash import parallel, reference

PUBLIC = [getattr(cuflash, name) for name in cuflash.__all__
          if callable(getattr(cuflash, name)) and not isinstance(getattr(cuflash, name), type)]  # functions, not error classes
PUBLIC += [parallel.ring_attention, parallel.ring_attention_backward, parallel.shard, parallel.unshard,
           parallel.decode_with_sharded_cache, parallel.run_local]
PUBLIC += [reference.attention_ref, reference.attention_backward_ref, reference.attention_varlen_ref,
           reference.attention_varlen_backward_ref, reference.naive_attention, reference.max_error_ratio]


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda f: f.__name__)
def test_every_parameter_is_documented(fn):
    doc = inspect.getdoc(fn)
    assert doc, f"{fn.__name__} has no docstring"
    params = doc.split("Parameters\n----------", 1)
    assert len(params) == 2, f"{fn.__name__}: no Parameters section"
    section = params[1].split("\n\nReturns", 1)[0]
    umbrella = re.search(r"options\n\s+As in :func:", section) is not None  # options documented at the source
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind == p.VAR_POSITIONAL:  # e.g. merge_states(*args): its call forms name each argument
            assert "Parameters" in doc and section.strip(), fn.__name__
            continue
        if p.kind == p.KEYWORD_ONLY and umbrella and name not in section:
            continue
        assert name in section, f"{fn.__name__}: parameter {name!r} is not documented"


@pytest.mark.parametrize("fn", [f for f in PUBLIC if f.__module__.startswith("cuflash.") and f.__module__ != "cuflash.reference"],
                         ids=lambda f: f.__name__)
def test_returns_raises_and_source(fn):
    doc = inspect.getdoc(fn)
    for section in ("Returns\n-------", "Raises\n------"):
        assert section in doc, f"{fn.__name__}: missing {section.splitlines()[0]}"
    assert any(word in doc for word in ("Dao", "Milakov", "FlashAttention", "Flash-Decoding")), \
        f"{fn.__name__}: no source (paper) named"


@pytest.mark.parametrize("fn", [f for f in PUBLIC if "Examples\n--------" in (inspect.getdoc(f) or "")],
                         ids=lambda f: f.__name__)
def test_docstring_examples_run(fn):
    """The Examples sections are doctests (NumPy inputs: they run without a GPU)."""
    import doctest

    finder, runner = doctest.DocTestFinder(recurse=False), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = finder.find(fn, fn.__name__, globs={})
    assert tests and tests[0].examples
    for test in tests:
        runner.run(test)
    assert runner.failures == 0, f"{fn.__name__}: {runner.failures} docstring example(s) failed"
