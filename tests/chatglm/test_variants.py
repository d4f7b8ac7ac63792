"""The variant table: each row's prompt format exists, its default profile is shipped and names it."""

import pytest

from conftest import REPO
from trtglm.chatglm.chat import PROMPT_IDS
from trtglm.chatglm.variants import VARIANTS, VERSIONS
from trtglm.profile import load_profile


def test_every_version_has_a_prompt_format_and_every_variant_a_version():
    assert set(PROMPT_IDS) == set(VERSIONS)
    assert {v.chatglm_version for v in VARIANTS.values()} <= set(VERSIONS)


@pytest.mark.parametrize("name", [n for n, v in VARIANTS.items() if v.profile])
def test_a_variants_default_profile_is_shipped_and_names_it(name):
    profile = load_profile(REPO / "configs" / f"{VARIANTS[name].profile}.yaml")
    assert profile.model.variant == name
    assert profile.chatglm_version == VARIANTS[name].chatglm_version
