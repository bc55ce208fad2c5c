from seeupo_gym.templates import ReActTemplate, strip_think


def test_parse_splits_thought_and_action():
    parsed = ReActTemplate().parse("<think>look up the file</think>\n[ls(a=True)]")
    assert parsed.thought == "look up the file"
    assert parsed.action == "[ls(a=True)]"
    assert parsed.think_closed


def test_response_without_reasoning_is_all_action():
    parsed = ReActTemplate().parse("[ls()]")
    assert parsed == type(parsed)(thought="", action="[ls()]", think_closed=True)


def test_unclosed_think_block_has_no_action():
    parsed = ReActTemplate().parse("<think>I will call [ls()] next")
    assert not parsed.think_closed
    assert parsed.action == ""


def test_render_round_trips_through_parse():
    template = ReActTemplate()
    parsed = template.parse(template.render("[cd(folder='x')]", thought="go"))
    assert (parsed.thought, parsed.action) == ("go", "[cd(folder='x')]")


def test_history_keeps_or_drops_thoughts_as_configured():
    response = "<think>secret plan</think>\nact()"
    assert ReActTemplate(keep_think=True).history_content(response) == response
    assert ReActTemplate(keep_think=False).history_content(response) == "act()"
    assert strip_think("<think>a</think> x <think>b</think> y") == "x y"


def test_system_prompt_has_every_section():
    prompt = ReActTemplate().system_prompt(
        role="You are an agent.", protocol="Finish with no calls.", action_format="Write calls.", tools="ls()"
    )
    for part in ["You are an agent.", "<think>", "Write calls.", "# Protocol", "Finish with no calls.", "# Tools", "ls()"]:
        assert part in prompt


def _strip_think_by_regex(text: str) -> str:
    """The reference: what strip_think computes, as a (quadratic) lazy regex."""
    import re

    return re.sub(r"<think>.*?</think>\s*", "", text, flags=re.DOTALL).strip()


def test_strip_think_agrees_with_the_regex_reference_on_random_responses():
    import random

    pieces = ["<think>", "</think>", "<think", "think>", "x", " ", "\n", "[ls()]", "é", "<", "/"]
    rng = random.Random(0)
    for _ in range(2_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(12)))
        assert strip_think(text) == _strip_think_by_regex(text), text


def test_strip_think_keeps_unclosed_blocks():
    assert strip_think("<think>a</think> x <think>never closed") == "x <think>never closed"
    assert strip_think("<think>" * 5_000) == "<think>" * 5_000
