"""Request-body checks, stop strings and chat templates, without a server."""
import pytest

from npuspec.serve.chat import ChatTemplate, load_chat_template
from npuspec.serve.protocol import APIError, ServerContext, parse_chat, parse_completion
from npuspec.serve.text import TextStream
from serve_helpers import CHATML, render_chatml


def _count(p):
    return len(p["prompt_token_ids"]) if isinstance(p, dict) else len(p.split())


def ctx(**kw):
    """A 64-token model named 'm' whose tokens are words."""
    return ServerContext(["m"], 64, _count, **kw)


def chat_ctx():
    t = ChatTemplate(CHATML)
    return ctx(render_chat=lambda m, agp: {"prompt": t.render(m, agp),
                                           "prompt_token_ids": [1] * 5})


def err(fn, body, c=None) -> APIError:
    with pytest.raises(APIError) as e:
        fn(body, c or ctx())
    return e.value


def test_completion_defaults_and_prompt_shapes():
    g = parse_completion({"model": "m", "prompt": "a b c"}, ctx())
    assert g.prompts == ["a b c"] and g.params.max_tokens == 16 and g.n == 1 and not g.stream
    assert g.params.temperature == 1.0  # OpenAI's default
    assert parse_completion({"prompt": [1, 2, 3]}, ctx()).prompts == [{"prompt_token_ids": [1, 2, 3]}]
    assert len(parse_completion({"prompt": [[1], [2, 3]]}, ctx()).prompts) == 2
    assert parse_completion({"prompt": ["a", "b"]}, ctx()).prompts == ["a", "b"]
    g = parse_completion({"prompt": "x", "temperature": 0, "top_k": 0, "seed": 3, "n": 2,
                          "stop": "\n\n", "stream": True,
                          "stream_options": {"include_usage": True},
                          "presence_penalty": 0, "echo": False, "user": "u"}, ctx())
    assert g.params.top_k == -1 and g.stop == ["\n\n"] and g.include_usage
    assert g.choice_params(1).seed == 4 and g.choice_params(0).seed == 3


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "x", "temprature": 0.5}, "temprature", "did you mean 'temperature'"),
    ({"prompt": "x", "logprobs": 1}, "logprobs", "token ids, not log-probabilities"),
    ({"prompt": "x", "echo": True}, "echo", "leave it out or send false"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"prompt": "x", "best_of": 3}, "best_of", "best_of"),
    ({"prompt": "x", "n": 0}, "n", "[1, 64]"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": "x", "max_tokens": 64}, "max_tokens", "ask for at most 63"),
    ({"prompt": "w " * 64}, "prompt", "max_model_len is 64"),
    ({"prompt": ["a", "w " * 70]}, "prompt[1]", "max_model_len"),
    ({"prompt": "x", "top_p": 2}, "top_p", "(0, 1]"),
    ({"prompt": "x", "stop": [""]}, "stop", "empty stop"),
    ({"prompt": "x", "stop": 3}, "stop", "string or a list"),
    ({"prompt": "x", "stream": "yes"}, "stream", "true or false"),
    ({"prompt": [1, "a"]}, "prompt", "list of token ids"),
    ({}, "prompt", "required"),
])
def test_completion_errors_name_the_field(body, param, words):
    e = err(parse_completion, body)
    assert e.status == 400 and e.param == param and words in e.message, e.message
    b = e.body()["error"]
    assert b["param"] == param and b["code"] == 400 and b["type"] == "BadRequestError"


def test_unknown_model_is_404():
    e = err(parse_completion, {"model": "gpt", "prompt": "x"})
    assert e.status == 404 and e.param == "model" and "['m']" in e.message


def test_chat_without_template_is_400():
    e = err(parse_chat, {"messages": [{"role": "user", "content": "hi"}]},
            ctx(chat_missing="the model X has no chat template"))
    assert e.status == 400 and e.param == "messages" and "X has no chat template" in e.message


def test_chat_parsing():
    c = chat_ctx()
    g = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                    "max_completion_tokens": 7}, c)
    assert g.prompts[0]["prompt"] == render_chatml([{"role": "user", "content": "hi"}])
    assert g.params.max_tokens == 7
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]}, c).params.max_tokens == 59
    assert err(parse_chat, {"messages": []}, c).param == "messages"
    assert err(parse_chat, {"messages": [{"role": "user", "content": 3}]}, c).param == \
        "messages[0].content"
    assert err(parse_chat, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
               c).param == "messages[0].tool_calls"
    assert err(parse_chat, {"messages": [{"role": "user", "content": "x"}],
                            "response_format": {"type": "json_object"}}, c).param == "response_format"
    assert err(parse_chat, {"messages": [{"role": "user", "content": "x"}], "logprobs": True},
               c).param == "logprobs"


def test_template_raise_exception_is_a_400():
    t = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}"
                     "{% endif %}{{ messages[0]['content'] }}")
    c = ctx(render_chat=lambda m, agp: {"prompt": t.render(m, agp), "prompt_token_ids": [1]})
    e = err(parse_chat, {"messages": [{"role": "system", "content": "x"}]}, c)
    assert e.param == "messages" and "user first" in e.message


def test_hf_tokenizer_config_template(tmp_path):
    import json
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"}],
         "bos_token": {"content": "<s>"}}))
    t = load_chat_template(str(tmp_path))
    assert t.render([{"role": "user", "content": "hi"}]) == "<s>hi"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert load_chat_template(str(tmp_path)).render([{}, {}]) == "J2"
    assert load_chat_template("tiny") is None


class _Tok:
    """Characters as tokens; id 0 is half of a two-token character (decodes to U+FFFD alone)."""
    def decode(self, ids, skip_special_tokens=True):
        s, i = "", 0
        while i < len(ids):
            if ids[i] == 0:
                s += "é" if i + 1 < len(ids) and ids[i + 1] == 1 else "\ufffd"
                i += 2 if i + 1 < len(ids) and ids[i + 1] == 1 else 1
            else:
                s += chr(ids[i])
                i += 1
        return s


def ids(text):
    return [ord(c) for c in text]


def test_stop_string_split_across_steps_never_leaks():
    ts = TextStream(_Tok(), ["STOP"])
    out = ts.add(ids("hello S")) + ts.add(ids("TO")) + ts.add(ids("P and more"))
    assert out == "hello " and ts.stopped and ts.num_tokens == len("hello STOP")


def test_no_stop_streams_everything_and_holds_half_characters():
    ts = TextStream(_Tok(), [])
    assert ts.add(ids("ab") + [0]) == ""  # text ending in half a character waits
    assert ts.add([1] + ids("c")) == "abéc"
    assert ts.add(ids("d")) == "d" and ts.prefix > 0  # decoded from a window, not from 0
    assert ts.add([], final=True) == "" and ts.num_tokens == 6


def test_earliest_of_several_stops_wins():
    ts = TextStream(_Tok(), ["xyz", "b"])
    assert ts.add(ids("aaxyzb"), final=False) == "aa" and ts.num_tokens == 5


def test_incremental_text_equals_a_whole_decode_on_a_real_tokenizer():
    """Random ids (partial UTF-8 bytes included) in random step sizes: the streamed text is
    the offline engine's tokenizer.decode(output)."""
    import random

    from npuspec.models.loading import load_tokenizer
    tok = load_tokenizer("tiny")
    rng = random.Random(0)
    for trial in range(20):
        out = [rng.randrange(tok.get_vocab_size()) for _ in range(rng.randrange(1, 120))]
        ts, text, i = TextStream(tok, []), "", 0
        while i < len(out):
            n = rng.randrange(1, 6)
            text += ts.add(out[i:i + n], final=i + n >= len(out))
            i += n
        assert text == tok.decode(out, skip_special_tokens=True), trial
