"""Chat formats of the served checkpoints, as pure text functions: prompt encoding,
and the parsing of what the model writes back (thinking and tool calls). Nothing here
touches a tokenizer or the engine, so every rule is testable on strings; the package
imports only the standard library (no other jlco package), and jlco.server is meant
to import it.

Modules
  deepseek_v32  DeepSeek-V3.2's encoder (the checkpoint ships it as Python, not Jinja)
  reasoning     `<think>` ... `</think>` split into reasoning_content / content
  tool_parsers  tool calls in DeepSeek-V3.2 (DSML) and GLM-5 (`<tool_call>`) syntax
  tool_stream   the OpenAI delta shapes and the parsers' shared streaming machine
  output        ChatOutput: both parsers in order, one object per response
  arguments     tool-call argument values -> JSON, typed by the request's schemas

Server wiring (one chat request, model_type from the checkpoint's config.json):

    from jlco.chat import deepseek_v32, output, reasoning, tool_parsers

    thinking = reasoning.thinking_from_kwargs(body.get("chat_template_kwargs"),
                                              default=False)  # GLM-5's default: True
    prompt = deepseek_v32.encode_messages(messages, tools=body.get("tools"),
                                          thinking=thinking)  # (GLM-5: its Jinja)
    # tokenize `prompt` with special tokens recognised as text, no extra BOS
    # simplest: out = output.ChatOutput(model_type, prompt, tools or None)
    #   streaming: out.feed(text_delta) -> [delta, ...]; out.finish() at the end
    #   whole: out.message(text) -> {"role", "content", "reasoning_content",
    #                                ["tool_calls"]}; out.tool_calls_seen for the
    #   finish_reason. What it does, in parts:
    think = reasoning.reasoning_parser_for(model_type, prompt)
    calls = tool_parsers.parser_for(model_type, body.get("tools"))  # when tools given

    # streaming: per decoded text delta (decode WITHOUT skipping special tokens:
    # </think>, ｜DSML｜ and <tool_call> must reach the parsers)
    for d in think.feed(text_delta):            # and think.finish() at the end
        if "reasoning_content" in d: send(d)
        else: for d2 in calls.feed(d["content"]): send(d2)   # then calls.finish()
    # whole response:
    reasoning_text, content = think.parse(text)
    content, tool_calls = calls.parse(content)  # [ToolCall(id, name, arguments)]
    # message.tool_calls = [c.as_openai() for c in tool_calls]; finish_reason
    # "tool_calls" when there are any; content "" -> null when tools were called.

    # usage.completion_tokens_details.reasoning_tokens:
    reasoning.count_reasoning_tokens(ids, start_id, end_id,
                                     reasoning.prompt_opens_thinking(prompt))

Each parser instance serves one response; `parse` leaves its streaming state alone.
Streamed deltas joined give exactly `parse`'s result, whatever the chunking.
"""
