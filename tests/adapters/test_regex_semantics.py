"""User regexes of adapter_config.json must mean what they mean to PEFT (Python's ``re``).

``PatternMatcher`` checks a pattern's syntax with ``re`` but matches it with the ``regex`` package (V0), which
gives some ``re``-valid patterns another meaning: ``{e<=1}`` is fuzzy matching (``re``: the literal text
``{e<=1}``) and ``[[:alpha:]]`` a POSIX class (``re``: a set followed by a literal ``]``). An adapter whose
``alpha_pattern`` key PEFT matches nowhere then gets another scaling in loraplex (served silently, different
tokens than PEFT); a ``target_modules`` regex PEFT matches nowhere is served. Either must be as PEFT or refused.
"""

from __future__ import annotations

import re
import warnings

import pytest
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.other import get_pattern_key

from loraplex.adapters.errors import AdapterError
from loraplex.adapters.peft_config import PeftLoraConfig

KEY = "model.layers.0.self_attn.q_proj"
RE_VALID_REGEX_SPECIAL = ["q_prox{e<=1}", "[[:alpha:]]_proj", r"q_proj\\{e<=1}"]


@pytest.mark.parametrize("pattern", RE_VALID_REGEX_SPECIAL)
def test_alpha_pattern_key_matches_as_peft_or_is_refused(pattern):
    raw = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "alpha_pattern": {pattern: 64}}
    try:
        hyper = PeftLoraConfig.from_dict(raw).hyperparams(KEY)
    except AdapterError:
        return  # a clear refusal is fine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # re: "Possible nested set"
        peft_alpha = raw["alpha_pattern"].get(get_pattern_key([pattern], KEY), raw["lora_alpha"])
    assert hyper.alpha == peft_alpha, f"loraplex alpha {hyper.alpha} != PEFT alpha {peft_alpha} for key {pattern!r}"


@pytest.mark.parametrize("pattern", [r".*\.q_prox{e<=1}", r".*\.[[:alpha:]]_proj"])
def test_target_modules_regex_targets_as_peft_or_is_refused(pattern):
    try:
        targeted = PeftLoraConfig.from_dict({"r": 8, "lora_alpha": 16, "target_modules": pattern}).targets(KEY, 0)
    except AdapterError:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert re.compile(pattern)  # valid for PEFT
        peft_targeted = bool(check_target_module_exists(LoraConfig(r=8, target_modules=pattern), KEY))
    assert targeted == peft_targeted
