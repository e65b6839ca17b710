"""The built-in open-ended prompt set: 24 chat requests with little to copy, held out from
every other prompt the project ships (demo, code-edit) and from the training corpus."""
import collections

from npuspec.cli_util import prompts as P


def test_open_ended_set_kinds_and_no_overlap():
    reqs = P.open_ended_requests()
    assert len(reqs) >= 20
    kinds = collections.Counter(r["kind"] for r in reqs)
    assert set(kinds) == {"explain", "story", "advice", "howto", "recipe", "compare"}, kinds
    assert min(kinds.values()) >= 3, kinds
    texts = [r["prompt"] for r in reqs]
    assert len(set(texts)) == len(texts)
    shipped = P.DEMO_PROMPTS + [P.code_edit_message(r) for r in P.code_edit_requests()]
    assert not any(t in s or s in t for t in texts for s in shipped)


def test_open_ended_plain_and_templated():
    plain = P.load_prompts("open-ended")  # no model: plain question/answer text
    reqs = P.open_ended_requests()
    assert plain == [f"Question: {r['prompt']}\n\nAnswer:" for r in reqs]

    class Tok:  # what the chat path needs of a transformers tokenizer
        chat_template = "stub"

        def apply_chat_template(self, conv, tokenize, add_generation_prompt):
            assert tokenize is False and add_generation_prompt is True
            return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in conv) + "<a>"

    templated = P.builtin_prompts("open-ended", tok=Tok())
    assert templated == [f"<user>{r['prompt']}</user><a>" for r in reqs]

