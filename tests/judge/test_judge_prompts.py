"""The judge prompt rendering, exactly as docs/judge-format.md documents it
(the tiny world corpus replicates it without importing judge/)."""

from __future__ import annotations

import pytest

from judge import prompts as P

REQUEST = [
    {"role": "system", "content": "You are helpful. It is 10:31."},
    {"role": "user", "content": "What does Ada like?"},
]
REPLY = {"role": "assistant", "content": "Ada likes tea.", "tool_calls": [
    {"id": "c1", "type": "function",
     "function": {"name": "lookup", "arguments": "{\"person\":\"Ada\"}"}}]}
NEXT = [{"role": "user", "content": "too long. answer in lowercase please"}]

EXPECTED_PRM = """Rate the assistant reply by what came next.
1 = progress (thanks, moves on, tool succeeded). -1 = redo, correction, change or error. 0 = unclear.
[CONTEXT]
user: What does Ada like?
[REPLY]
assistant: Ada likes tea.
call lookup({"person":"Ada"})
[NEXT]
user: too long. answer in lowercase please
[FEEDBACK]
thumbs down: too formal
Reason in one line, then answer \\boxed{1}, \\boxed{-1} or \\boxed{0}."""


def test_prm_prompt_matches_the_documented_example() -> None:
    fields = P.render_fields(REQUEST, REPLY, NEXT, [P.FeedbackItem(-1, "too formal")])
    assert P.render_prm(fields) == EXPECTED_PRM


def test_no_feedback_leaves_no_blank_line_and_hint_prompt_ends_with_answer() -> None:
    fields = P.render_fields(REQUEST, {"role": "assistant", "content": "Tea."}, NEXT)
    hint = P.render_hint(fields)
    assert "[FEEDBACK]" not in hint and "\n\n" not in hint
    assert hint.endswith("user: too long. answer in lowercase please\nAnswer:")
    assert hint.startswith("Does what came next say how the reply should have been different?")


def test_blocks_roles_parts_tool_results_and_truncation() -> None:
    request = [{"role": "user", "content": f"q{i}"} for i in range(6)]
    assert P.render_context(request) == "user: q2\nuser: q3\nuser: q4\nuser: q5"
    parts = {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "image_url", "image_url": {"url": "x"}},
                                         {"type": "text", "text": "b"}]}
    assert P.render_message(parts) == "user: a\nb"
    assert P.render_message({"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": {"x": 1}}}]}) == 'assistant: call f({"x":1})'
    assert P.render_message({"role": "assistant", "content": ""}) == "assistant:"
    tools = [{"role": "tool", "tool_call_id": "c1", "content": '{"ok": true}'},
             {"role": "tool", "tool_call_id": "c2", "content": "error: not found"}]
    fields = P.render_fields([], None, tools)
    assert fields["next_state"] == 'tool: {"ok": true}\ntool: error: not found'
    assert fields["reply"] == "assistant:"
    long = P.render_message({"role": "user", "content": "x" * 700})
    assert long == "user: " + "x" * 600 + "..."
    fb = P.render_feedback([P.FeedbackItem(1, None), P.FeedbackItem(None, " nice ")])
    assert fb == "[FEEDBACK]\nthumbs up\ncomment: nice\n"


def test_teacher_messages_append_the_hint_to_the_last_user_message() -> None:
    request = [*REQUEST, {"role": "assistant", "content": "Tea."},
               {"role": "user", "content": [{"type": "text", "text": "And Bob?"}]}]
    out = P.teacher_messages(request, "  Answer in lowercase. ")
    assert out[:3] == request[:3]
    assert out[3] == {"role": "user", "content": "And Bob?\n\nHint: Answer in lowercase."}
    assert request[3]["content"] == [{"type": "text", "text": "And Bob?"}]  # not mutated
    with pytest.raises(ValueError, match="no user message"):
        P.teacher_messages([{"role": "system", "content": "s"}], "hint")


def test_judge_prompt_is_one_user_message_and_versions_are_files() -> None:
    assert P.judge_messages("p") == [{"role": "user", "content": "p"}]
    with pytest.raises(FileNotFoundError):
        P.load_template("prm", "v999")
    with pytest.raises(ValueError):
        P.load_template("prm", "../x")


def test_v3_asks_for_verdict_and_hint_in_one_prompt() -> None:
    """v3 (the judge model's prompt) is one template: the next state, then the question."""
    fields = P.render_fields(REQUEST, REPLY, NEXT, [P.FeedbackItem(-1, "too formal")])
    assert P.is_combined("v3") and not P.is_combined("v1") and not P.is_combined("v2")
    assert P.render_judge(fields, "v3") == (
        "[NEXT]\nuser: too long. answer in lowercase please\n[FEEDBACK]\n"
        "thumbs down: too formal\n"
        "Verdict (1 accepted, -1 corrected, 0 unclear) and the change asked for, if any:")
    P.check_version("v3")
    assert P.is_combined("v4") and P.score_first("v4") and not P.score_first("v3")
    assert P.render_judge(fields, "v4").endswith(
        "Verdict first (1 accepted, -1 corrected, 0 unclear), then the change asked for, "
        "if any:")
    P.check_version("v4")
    P.check_version("v1")
    with pytest.raises(FileNotFoundError):
        P.check_version("v999")


def test_an_agent_step_is_shown_beside_what_came_back_and_people_turns_are_unchanged() -> None:
    """v5 (docs/judge-format.md): a reply with tool calls gets a [STEP] block with the task
    (the first user message), the last user message when there are more, and the calls; any
    other reply renders exactly as v4."""
    task = [{"role": "system", "content": "Use the tools."},
            {"role": "user", "content": "Where does Femi live?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c0", "type": "function",
         "function": {"name": "lookup", "arguments": '{"person": "Femi", "attribute": "pet"}'}}]}
    result = [{"role": "tool", "tool_call_id": "c0", "content": "Femi has a dog."}]
    assert P.render_judge(P.render_fields(task, call, result), "v5") == (
        "[STEP]\nuser: Where does Femi live?\n"
        'assistant: call lookup({"person": "Femi", "attribute": "pet"})\n'
        "[NEXT]\ntool: Femi has a dog.\n"
        "Verdict first (1 accepted, -1 corrected, 0 unclear), then the change asked for, "
        "if any:")
    nudged = [*task, {"role": "assistant", "content": "Femi lives in Oslo."},
              {"role": "user", "content": "use the tools"}]
    assert P.render_fields(nudged, call, result)["step"] == (
        "[STEP]\nuser: Where does Femi live?\nuser: use the tools\n"
        'assistant: call lookup({"person": "Femi", "attribute": "pet"})\n')
    for reply in ({"role": "assistant", "content": "Femi lives in Oslo."}, None):
        fields = P.render_fields(task, reply, [{"role": "user", "content": "thanks!"}])
        assert fields["step"] == ""
        assert P.render_judge(fields, "v5") == P.render_judge(fields, "v4")
