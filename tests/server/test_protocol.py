"""The wire format: bodies parse as the documented response models; bad fields become one 400."""

from __future__ import annotations

import pytest

from sglang_adaflash.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ResponseBuilder,
    parse,
)


@pytest.mark.parametrize("chat, model", [(False, CompletionResponse), (True, ChatCompletionResponse)])
def test_full_bodies_match_the_response_models(chat, model):
    body = ResponseBuilder(chat, "m", "id-1", "v000001").full("hi", "stop", 3, [5, 6], token_ids=True)
    parsed = model.model_validate(body)
    assert parsed.usage.total_tokens == 5 and parsed.choices[0].finish_reason == "stop"
    assert body["choices"][0]["token_ids"] == [5, 6]


def test_chunks_carry_a_delta_for_chat_and_text_for_completions():
    chat = ResponseBuilder(True, "m", "id", None)
    assert chat.chunk("", role=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat.chunk(None, "length")["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                                       "finish_reason": "length"}
    text = ResponseBuilder(False, "m", "id", None)
    assert CompletionResponse.model_validate(text.chunk("ab")).choices[0].text == "ab"
    assert text.usage_chunk(2, 3)["choices"] == [] and text.usage_chunk(2, 3)["usage"]["total_tokens"] == 5


def test_defaults_follow_openai():
    req = parse(CompletionRequest, {"model": "m", "prompt": ["only one"], "temperature": None})
    assert req.sampling_values() == (1.0, 1.0, 0) and req.single_prompt() == "only one"
    assert parse(CompletionRequest, {"model": "m", "prompt": [[1, 2]], "top_k": -1}).sampling_values()[2] == 0
    chat = parse(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert chat.conversation() == [{"role": "system", "content": "ab"}]


@pytest.mark.parametrize("model, body, param", [
    (CompletionRequest, {"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    (CompletionRequest, {"model": "m", "prompt": "x", "stop": [""]}, "stop"),
    (CompletionRequest, {"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user"}], "max_tokens": 0}, "max_tokens"),
])
def test_bad_fields_become_one_400_naming_the_field(model, body, param):
    with pytest.raises(APIError) as e:
        parse(model, body)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("body, param", [
    ({"n": 2}, "n"), ({"logprobs": 2}, "logprobs"), ({"echo": True}, "echo"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"prompt": ["a", "b"]}, "prompt"),
])
def test_unsupported_parameters_are_refused_by_name(body, param):
    req = parse(CompletionRequest, {"model": "m", "prompt": "x", **body})
    with pytest.raises(APIError) as e:
        req.check_supported()
        req.single_prompt()
    assert e.value.param == param and e.value.code == "unsupported_parameter"
