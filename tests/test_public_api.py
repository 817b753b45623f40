"""The public API: every name in `hf_ccl.__all__` resolves, and `import hf_ccl` alone stays light."""

from __future__ import annotations

import subprocess
import sys

import hf_ccl


def test_every_public_name_resolves_to_its_module_object():
    import hf_ccl.continual
    import hf_ccl.data
    import hf_ccl.methods

    assert set(hf_ccl.__all__) == {"__version__", *hf_ccl._PUBLIC}
    for name in hf_ccl.__all__:
        assert getattr(hf_ccl, name) is not None, name
    assert hf_ccl.ContinualLearner is hf_ccl.continual.ContinualLearner
    assert hf_ccl.build_stream is hf_ccl.data.build_stream
    assert hf_ccl.build_methods is hf_ccl.methods.build_methods


def test_unknown_name_is_an_attribute_error():
    try:
        hf_ccl.NoSuchThing  # noqa: B018
    except AttributeError as error:
        assert "NoSuchThing" in str(error)
    else:
        raise AssertionError("hf_ccl.NoSuchThing resolved")


def test_import_hf_ccl_does_not_import_torch_or_transformers():
    code = "import sys, hf_ccl; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
