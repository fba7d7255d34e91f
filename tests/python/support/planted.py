"""``ropescale verify`` against a planted engine: a sitecustomize on the probe process's PYTHONPATH that makes the
engine drop one rope key (issue 59), so a test can show the verdict names it."""

from __future__ import annotations

import os
from pathlib import Path

# transformers itself with its YaRN made to drop the key named by ROPESCALE_TEST_DROP from rope_parameters (wraps
# ROPE_INIT_FUNCTIONS["yarn"]); a key without a default in transformers (original_max_position_embeddings) takes the
# one an engine falls back to, max_position_embeddings.
TRANSFORMERS_DROPS_ONE_KEY = '''
import os
import transformers.modeling_rope_utils as rope

KEY, YARN = os.environ["ROPESCALE_TEST_DROP"], rope.ROPE_INIT_FUNCTIONS["yarn"]


def dropped(config, *args, **kwargs):
    params = dict(config.rope_parameters)
    if KEY == "original_max_position_embeddings":
        params[KEY] = config.max_position_embeddings
    else:
        params.pop(KEY, None)  # called again on the same config (the weights' init): already dropped
    config.rope_parameters = params
    return YARN(config, *args, **kwargs)


rope.ROPE_INIT_FUNCTIONS["yarn"] = dropped
'''


def verify_planted(path, engine: str, site: Path, plant: str, key: str | None, monkeypatch, **env: str):
    """``verify.verify(path, engine)`` with ``plant`` written as ``site/sitecustomize.py`` and put first on the probe's
    PYTHONPATH, ``ROPESCALE_TEST_DROP=key`` and ``env`` set (``key`` None: the engine as it is). Returns the report
    and its checks by name."""
    from ropescale import verify  # on use: a test file importing this may skip before ropescale loads

    if key is not None:
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(plant)
        for name, value in {"ROPESCALE_TEST_DROP": key, **env}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    report = verify.verify(path, engine)
    print(report.text())
    return report, {c.name: c for c in report.checks}
