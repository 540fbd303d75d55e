// Chat templates: the real templates of Qwen3 (from the qwen3moe-tiny GGUF) and Gemma 3 (from
// tokenizers/gemma3-vocab.gguf), and the published templates of Qwen3.5/3.6 and Gemma 4 (their text is
// below), rendered by fitmoe's Jinja interpreter. Every expected string is written by hand from the model's
// documented prompt format, not copied from fitmoe's output. Plus unit tests of the interpreter itself.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "format/gguf.h"
#include "runtime/error.h"
#include "testdata.h"
#include "text/chat.h"
#include "text/jinja.h"
#include "text/tokenizer.h"

using namespace fitmoe;
using ojson = nlohmann::ordered_json;

namespace {

// Qwen3.5 / Qwen3.6 chat template as published with the models (tokenizer_config.json / chat_template.jinja).
const std::string kQwen35Template = R"TPL({%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- macro render_content(content, do_vision_count, is_system_content=false) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if 'image' in item or 'image_url' in item or item.type == 'image' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain images.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set image_count.value = image_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Picture ' ~ image_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif 'video' in item or item.type == 'video' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain videos.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set video_count.value = video_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Video ' ~ video_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- else %}
                {{- raise_exception('Unexpected item type in content.') }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is none or content is undefined %}
        {{- '' }}
    {%- else %}
        {{- raise_exception('Unexpected content type.') }}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true)|trim %}
        {%- if content %}
            {{- '\n\n' + content }}
        {%- endif %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true)|trim %}
        {{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set content = render_content(message.content, false)|trim %}
        {%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content, true)|trim %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content|trim %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if loop.first %}
                    {%- if content|trim %}
                        {{- '\n\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- else %}
                        {{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- endif %}
                {%- else %}
                    {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- endif %}
                {%- if tool_call.arguments is defined %}
                    {%- for args_name, args_value in tool_call.arguments|items %}
                        {{- '<parameter=' + args_name + '>\n' }}
                        {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                        {{- args_value }}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %})TPL";

// Gemma 4 chat template as published with the instruction-tuned models (chat_template.jinja).
const std::string kGemma4Template = R"TPL({%- macro format_parameters(properties, required) -%}
    {%- set standard_keys = ['description', 'type', 'properties', 'required', 'nullable'] -%}
    {%- set ns = namespace(found_first=false) -%}
    {%- for key, value in properties | dictsort -%}
        {%- set add_comma = false -%}
        {%- if key not in standard_keys -%}
            {%- if ns.found_first %},{% endif -%}
            {%- set ns.found_first = true -%}
            {{ key }}:{
            {%- if value['description'] -%}
                description:<|"|>{{ value['description'] }}<|"|>
                {%- set add_comma = true -%}
            {%- endif -%}
            {%- if value['type'] | upper == 'STRING' -%}
                {%- if value['enum'] -%}
                    {%- if add_comma %},{%- else -%} {%- set add_comma = true -%} {% endif -%}
                    enum:{{ format_argument(value['enum']) }}
                {%- endif -%}
            {%- elif value['type'] | upper == 'ARRAY' -%}
                {%- if value['items'] is mapping and value['items'] -%}
                    {%- if add_comma %},{%- else -%} {%- set add_comma = true -%} {% endif -%}
                    items:{
                    {%- set ns_items = namespace(found_first=false) -%}
                    {%- for item_key, item_value in value['items'] | dictsort -%}
                        {%- if item_value is not none -%}
                            {%- if ns_items.found_first %},{% endif -%}
                            {%- set ns_items.found_first = true -%}
                            {%- if item_key == 'properties' -%}
                                properties:{
                                {%- if item_value is mapping -%}
                                    {{- format_parameters(item_value, value['items']['required'] | default([])) -}}
                                {%- endif -%}
                                }
                            {%- elif item_key == 'required' -%}
                                required:[
                                {%- for req_item in item_value -%}
                                    <|"|>{{- req_item -}}<|"|>
                                    {%- if not loop.last %},{% endif -%}
                                {%- endfor -%}
                                ]
                            {%- elif item_key == 'type' -%}
                                {%- if item_value is string -%}
                                    type:{{ format_argument(item_value | upper) }}
                                {%- else -%}
                                    type:{{ format_argument(item_value | map('upper') | list) }}
                                {%- endif -%}
                            {%- else -%}
                                {{ item_key }}:{{ format_argument(item_value) }}
                            {%- endif -%}
                        {%- endif -%}
                    {%- endfor -%}
                    }
                {%- endif -%}
            {%- endif -%}
            {%- if value['nullable'] %}
                {%- if add_comma %},{%- else -%} {%- set add_comma = true -%} {% endif -%}
                nullable:true
            {%- endif -%}
            {%- if value['type'] | upper == 'OBJECT' -%}
                {%- if value['properties'] is defined and value['properties'] is mapping -%}
                    {%- if add_comma %},{%- else -%} {%- set add_comma = true -%} {% endif -%}
                    properties:{
                    {{- format_parameters(value['properties'], value['required'] | default([])) -}}
                    }
                {%- elif value is mapping -%}
                    {%- if add_comma %},{%- else -%} {%- set add_comma = true -%} {% endif -%}
                    properties:{
                    {{- format_parameters(value, value['required'] | default([])) -}}
                    }
                {%- endif -%}
                {%- if value['required'] -%}
                    {%- if add_comma %},{%- else -%} {%- set add_comma = true -%} {% endif -%}
                    required:[
                    {%- for item in value['required'] | default([]) -%}
                        <|"|>{{- item -}}<|"|>
                        {%- if not loop.last %},{% endif -%}
                    {%- endfor -%}
                    ]
                {%- endif -%}
            {%- endif -%}
            {%- if add_comma %},{%- else -%} {%- set add_comma = true -%} {% endif -%}
            type:<|"|>{{ value['type'] | upper }}<|"|>}
        {%- endif -%}
    {%- endfor -%}
{%- endmacro -%}
{%- macro format_function_declaration(tool_data) -%}
    declaration:{{- tool_data['function']['name'] -}}{description:<|"|>{{- tool_data['function']['description'] -}}<|"|>
    {%- set params = tool_data['function']['parameters'] -%}
    {%- if params -%}
        ,parameters:{
        {%- if params['properties'] -%}
            properties:{ {{- format_parameters(params['properties'], params['required']) -}} },
        {%- endif -%}
        {%- if params['required'] -%}
            required:[
            {%- for item in params['required'] -%}
                <|"|>{{- item -}}<|"|>
                {{- ',' if not loop.last -}}
            {%- endfor -%}
            ],
        {%- endif -%}
        {%- if params['type'] -%}
            type:<|"|>{{- params['type'] | upper -}}<|"|>}
        {%- endif -%}
    {%- endif -%}
    {%- if 'response' in tool_data['function'] -%}
        {%- set response_declaration = tool_data['function']['response'] -%}
        ,response:{
        {%- if response_declaration['description'] -%}
            description:<|"|>{{- response_declaration['description'] -}}<|"|>,
        {%- endif -%}
        {%- if response_declaration['type'] | upper == 'OBJECT' -%}
            type:<|"|>{{- response_declaration['type'] | upper -}}<|"|>}
        {%- endif -%}
    {%- endif -%}
    }
{%- endmacro -%}
{%- macro format_argument(argument, escape_keys=True) -%}
    {%- if argument is string -%}
        {{- '<|"|>' + argument + '<|"|>' -}}
    {%- elif argument is boolean -%}
        {{- 'true' if argument else 'false' -}}
    {%- elif argument is mapping -%}
        {{- '{' -}}
        {%- set ns = namespace(found_first=false) -%}
        {%- for key, value in argument | dictsort -%}
            {%- if ns.found_first %},{% endif -%}
            {%- set ns.found_first = true -%}
            {%- if escape_keys -%}
                {{- '<|"|>' + key + '<|"|>' -}}
            {%- else -%}
                {{- key -}}
            {%- endif -%}
            :{{- format_argument(value, escape_keys=escape_keys) -}}
        {%- endfor -%}
        {{- '}' -}}
    {%- elif argument is sequence -%}
        {{- '[' -}}
        {%- for item in argument -%}
            {{- format_argument(item, escape_keys=escape_keys) -}}
            {%- if not loop.last %},{% endif -%}
        {%- endfor -%}
        {{- ']' -}}
    {%- else -%}
        {{- argument -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro strip_thinking(text) -%}
    {%- set ns = namespace(result='') -%}
    {%- for part in text.split('<channel|>') -%}
        {%- if '<|channel>' in part -%}
            {%- set ns.result = ns.result + part.split('<|channel>')[0] -%}
        {%- else -%}
            {%- set ns.result = ns.result + part -%}
        {%- endif -%}
    {%- endfor -%}
    {{- ns.result | trim -}}
{%- endmacro -%}

{%- macro format_tool_response_block(tool_name, response) -%}
    {{- '<|tool_response>' -}}
    {%- if response is mapping -%}
        {{- 'response:' + tool_name + '{' -}}
        {%- for key, value in response | dictsort -%}
            {{- key -}}:{{- format_argument(value, escape_keys=False) -}}
            {%- if not loop.last %},{% endif -%}
        {%- endfor -%}
        {{- '}' -}}
    {%- else -%}
        {{- 'response:' + tool_name + '{value:' + format_argument(response, escape_keys=False) + '}' -}}
    {%- endif -%}
    {{- '<tool_response|>' -}}
{%- endmacro -%}

{%- set ns = namespace(prev_message_type=None) -%}
{%- set loop_messages = messages -%}
{{- bos_token -}}
{#- Handle System/Tool Definitions Block -#}
{%- if (enable_thinking is defined and enable_thinking) or tools or messages[0]['role'] in ['system', 'developer'] -%}
    {{- '<|turn>system\n' -}}

    {#- Inject Thinking token at the very top of the FIRST system turn -#}
    {%- if enable_thinking is defined and enable_thinking -%}
        {{- '<|think|>\n' -}}
        {%- set ns.prev_message_type = 'think' -%}
    {%- endif -%}

    {%- if messages[0]['role'] in ['system', 'developer'] -%}
        {{- messages[0]['content'] | trim -}}
        {%- set loop_messages = messages[1:] -%}
    {%- endif -%}

    {%- if tools -%}
        {%- for tool in tools %}
            {{- '<|tool>' -}}
            {{- format_function_declaration(tool) | trim -}}
            {{- '<tool|>' -}}
        {%- endfor %}
        {%- set ns.prev_message_type = 'tool' -%}
    {%- endif -%}

    {{- '<turn|>\n' -}}
{%- endif %}

{#- Pre-scan: find last user message index for reasoning guard -#}
{%- set ns_turn = namespace(last_user_idx=-1) -%}
{%- for i in range(loop_messages | length) -%}
    {%- if loop_messages[i]['role'] == 'user' -%}
        {%- set ns_turn.last_user_idx = i -%}
    {%- endif -%}
{%- endfor -%}

{#- Loop through messages -#}
{%- for message in loop_messages -%}
    {%- if message['role'] != 'tool' -%}
    {%- set ns.prev_message_type = None -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {#- Detect continuation: suppress duplicate <|turn>model when previous non-tool message was also assistant -#}
    {%- set prev_nt = namespace(role=None, found=false) -%}
    {%- if loop.index0 > 0 -%}
        {%- for j in range(loop.index0 - 1, -1, -1) -%}
            {%- if not prev_nt.found -%}
                {%- if loop_messages[j]['role'] != 'tool' -%}
                    {%- set prev_nt.role = loop_messages[j]['role'] -%}
                    {%- set prev_nt.found = true -%}
                {%- endif -%}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {%- set continue_same_model_turn = (role == 'model' and prev_nt.role == 'assistant') -%}
    {%- if not continue_same_model_turn -%}
        {{- '<|turn>' + role + '\n' }}
    {%- endif -%}

    {#- Render reasoning/reasoning_content as thinking channel -#}
    {%- set thinking_text = message.get('reasoning') or message.get('reasoning_content') -%}
    {%- if thinking_text and loop.index0 > ns_turn.last_user_idx and message.get('tool_calls') -%}
        {{- '<|channel>thought\n' + thinking_text + '\n<channel|>' -}}
    {%- endif -%}

            {%- if message['tool_calls'] -%}
                {%- for tool_call in message['tool_calls'] -%}
                    {%- set function = tool_call['function'] -%}
                    {{- '<|tool_call>call:' + function['name'] + '{' -}}
                    {%- if function['arguments'] is mapping -%}
                        {%- set ns_args = namespace(found_first=false) -%}
                        {%- for key, value in function['arguments'] | dictsort -%}
                            {%- if ns_args.found_first %},{% endif -%}
                            {%- set ns_args.found_first = true -%}
                            {{- key -}}:{{- format_argument(value, escape_keys=False) -}}
                        {%- endfor -%}
                    {%- elif function['arguments'] is string -%}
                        {{- function['arguments'] -}}
                    {%- endif -%}
                    {{- '}<tool_call|>' -}}
                {%- endfor -%}
                {%- set ns.prev_message_type = 'tool_call' -%}
            {%- endif -%}

            {%- set ns_tr_out = namespace(flag=false) -%}
            {%- if message.get('tool_responses') -%}
                {#- Legacy: tool_responses embedded on the assistant message (Google/Gemma native) -#}
                {%- for tool_response in message['tool_responses'] -%}
                    {{- format_tool_response_block(tool_response['name'] | default('unknown'), tool_response['response']) -}}
                    {%- set ns_tr_out.flag = true -%}
                    {%- set ns.prev_message_type = 'tool_response' -%}
                {%- endfor -%}
            {%- elif message.get('tool_calls') -%}
                {#- OpenAI Chat Completions: forward-scan consecutive role:tool messages -#}
                {%- set ns_tool_scan = namespace(stopped=false) -%}
                {%- for k in range(loop.index0 + 1, loop_messages | length) -%}
                    {%- if ns_tool_scan.stopped -%}
                    {%- elif loop_messages[k]['role'] != 'tool' -%}
                        {%- set ns_tool_scan.stopped = true -%}
                    {%- else -%}
                        {%- set follow = loop_messages[k] -%}
                        {#- Resolve tool_call_id to function name -#}
                        {%- set ns_tname = namespace(name=follow.get('name') | default('unknown')) -%}
                        {%- for tc in message['tool_calls'] -%}
                            {%- if tc.get('id') == follow.get('tool_call_id') -%}
                                {%- set ns_tname.name = tc['function']['name'] -%}
                            {%- endif -%}
                        {%- endfor -%}
                        {#- Handle content as string or content-parts array -#}
                        {%- set tool_body = follow.get('content') -%}
                        {%- if tool_body is string -%}
                            {{- format_tool_response_block(ns_tname.name, tool_body) -}}
                        {%- elif tool_body is sequence and tool_body is not string -%}
                            {%- set ns_txt = namespace(s='') -%}
                            {%- for part in tool_body -%}
                                {%- if part.get('type') == 'text' -%}
                                    {%- set ns_txt.s = ns_txt.s + (part.get('text') | default('')) -%}
                                {%- endif -%}
                            {%- endfor -%}
                            {{- format_tool_response_block(ns_tname.name, ns_txt.s) -}}
                        {%- else -%}
                            {{- format_tool_response_block(ns_tname.name, tool_body) -}}
                        {%- endif -%}
                        {%- set ns_tr_out.flag = true -%}
                        {%- set ns.prev_message_type = 'tool_response' -%}
                    {%- endif -%}
                {%- endfor -%}
            {%- endif -%}

            {%- if message['content'] is string -%}
                {%- if role == 'model' -%}
                    {{- strip_thinking(message['content']) -}}
                {%- else -%}
                    {{- message['content'] | trim -}}
                {%- endif -%}
            {%- elif message['content'] is sequence -%}
                {%- for item in message['content'] -%}
                    {%- if item['type'] == 'text' -%}
                        {%- if role == 'model' -%}
                            {{- strip_thinking(item['text']) -}}
                        {%- else -%}
                            {{- item['text'] | trim -}}
                        {%- endif -%}
                    {%- elif item['type'] == 'image' -%}
                        {{- '<|image|>' -}}
                        {%- set ns.prev_message_type = 'image' -%}
                    {%- elif item['type'] == 'audio' -%}
                        {{- '<|audio|>' -}}
                        {%- set ns.prev_message_type = 'audio' -%}
                    {%- elif item['type'] == 'video' -%}
                        {{- '<|video|>' -}}
                        {%- set ns.prev_message_type = 'video' -%}
                    {%- endif -%}
                {%- endfor -%}
            {%- endif -%}

        {%- if ns.prev_message_type == 'tool_call' and not ns_tr_out.flag -%}
            {{- '<|tool_response>' -}}
        {%- elif not (ns_tr_out.flag and not message.get('content')) -%}
            {{- '<turn|>\n' -}}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}

{%- if add_generation_prompt -%}
    {%- if ns.prev_message_type != 'tool_response' and ns.prev_message_type != 'tool_call' -%}
        {{- '<|turn>model\n' -}}
        {%- if not enable_thinking | default(false) -%}
            {{- '<|channel>thought\n<channel|>' -}}
        {%- endif -%}
    {%- endif -%}
{%- endif -%}
)TPL";

struct Loaded {
  std::shared_ptr<gguf::File> file;
  std::unique_ptr<Tokenizer> tok;
};

const Tokenizer& tok(const std::string& rel) {
  static std::map<std::string, Loaded> cache;
  auto it = cache.find(rel);
  if (it == cache.end()) {
    Loaded l;
    l.file = gguf::File::open(test::testdata(rel));
    l.tok = Tokenizer::from_gguf(*l.file);
    it = cache.emplace(rel, std::move(l)).first;
  }
  return *it->second.tok;
}

std::string render(const std::string& tmpl, const std::string& ctx_json) {
  return jinja::Template(tmpl).render(ojson::parse(ctx_json));
}

// Expects a fitmoe::Error whose message contains `part`.
template <class F>
void expect_error(F&& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << part << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

ojson weather_tool() {
  return ojson::parse(R"({"type": "function", "function": {"name": "get_weather", "description": "Get weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
    "required": ["city"]}}})");
}

}  // namespace

// ---------------------------------------------------------------------------------------------- Qwen3

TEST(ChatTemplate, Qwen3Basic) {
  const Tokenizer& t = tok("qwen3moe-tiny/qwen3moe-tiny-f32.gguf");
  std::vector<ChatMessage> msgs = {{"system", "You are a helpful assistant."}, {"user", "Hello"}};
  EXPECT_EQ(apply_chat_template(t, msgs, true),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nHello<|im_end|>\n"
            "<|im_start|>assistant\n");
  // enable_thinking=false pre-fills an empty think block.
  EXPECT_EQ(apply_chat_template(t, msgs, true, {{"enable_thinking", false}}),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nHello<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n");
  // Without a generation prompt, and without a system message.
  EXPECT_EQ(apply_chat_template(t, {{"user", "Hello"}}, false), "<|im_start|>user\nHello<|im_end|>\n");
  // The full vocabulary carries the same template.
  EXPECT_EQ(tok("tokenizers/qwen3-vocab.gguf").chat_template(), t.chat_template());
}

TEST(ChatTemplate, Qwen3MultiTurnDropsOldReasoning) {
  const Tokenizer& t = tok("qwen3moe-tiny/qwen3moe-tiny-f32.gguf");
  std::vector<ChatMessage> msgs = {{"user", "Hi"},
                                   {"assistant", "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"},
                                   {"user", "Tell me a joke."}};
  // Reasoning of turns before the last user query is not shown again.
  EXPECT_EQ(apply_chat_template(t, msgs, true),
            "<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
            "<|im_start|>user\nTell me a joke.<|im_end|>\n"
            "<|im_start|>assistant\n");
  // An assistant turn after the last query keeps its reasoning, normalised to "<think>\n...\n</think>\n\n".
  std::vector<ChatMessage> m2 = {{"user", "2+2?"}, {"assistant", "<think>\n\nsimple\n\n</think>\n\n\n4"}};
  EXPECT_EQ(apply_chat_template(t, m2, false),
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nsimple\n</think>\n\n4<|im_end|>\n");
  // reasoning_content as a separate field.
  ChatMessage a{"assistant", "4", {{"reasoning_content", "add"}}};
  EXPECT_EQ(apply_chat_template(t, {{"user", "2+2?"}, a}, false),
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nadd\n</think>\n\n4<|im_end|>\n");
}

TEST(ChatTemplate, Qwen3ToolsAndToolCalls) {
  const Tokenizer& t = tok("qwen3moe-tiny/qwen3moe-tiny-f32.gguf");
  ojson tools = ojson::array({weather_tool()});
  ChatMessage call{"assistant", "", ojson::parse(R"({"tool_calls": [{"type": "function", "function":
      {"name": "get_weather", "arguments": {"city": "Paris"}}}]})")};
  std::vector<ChatMessage> msgs = {
      {"system", "Be brief."}, {"user", "Weather in Paris?"}, call, {"tool", "22C, sunny"}};
  EXPECT_EQ(apply_chat_template(t, msgs, true, {{"tools", tools}}),
            "<|im_start|>system\nBe brief.\n\n"
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Get weather\", "
            "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\", "
            "\"description\": \"City name\"}}, \"required\": [\"city\"]}}}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call><|im_end|>\n"
            "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
            "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
            "</tool_call><|im_end|>\n"
            "<|im_start|>user\n<tool_response>\n22C, sunny\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n");
}

TEST(ChatTemplate, Qwen3PromptTokenizes) {
  const Tokenizer& t = tok("tokenizers/qwen3-vocab.gguf");
  std::string p = apply_chat_template(t, {{"user", "Hi"}}, true);
  auto ids = t.encode(p, true);
  // <|im_start|> user \n Hi <|im_end|> \n <|im_start|> assistant \n
  ASSERT_GE(ids.size(), 6u);
  EXPECT_EQ(ids.front(), 151644);
  EXPECT_EQ(ids[ids.size() - 3], 151644);
  EXPECT_EQ(t.decode(ids), p);
}

// ---------------------------------------------------------------------------------------------- Gemma 3

TEST(ChatTemplate, Gemma3) {
  const Tokenizer& t = tok("tokenizers/gemma3-vocab.gguf");
  ASSERT_FALSE(t.chat_template().empty());
  std::vector<ChatMessage> msgs = {{"system", "You are helpful."}, {"user", "Hi"}};
  // The system prompt is folded into the first user turn; "assistant" is called "model".
  EXPECT_EQ(render_chat(t.chat_template(), msgs, true, {{"bos_token", "<bos>"}}),
            "<bos><start_of_turn>user\nYou are helpful.\n\nHi<end_of_turn>\n<start_of_turn>model\n");
  // apply_chat_template drops the <bos> text because the tokenizer adds BOS itself.
  std::string p = apply_chat_template(t, msgs, true);
  EXPECT_EQ(p, "<start_of_turn>user\nYou are helpful.\n\nHi<end_of_turn>\n<start_of_turn>model\n");
  auto ids = t.encode(p, true);
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids[0], 2);    // one <bos>
  EXPECT_EQ(ids[1], 105);  // <start_of_turn>
  std::vector<ChatMessage> turns = {{"user", "  Hi  "}, {"assistant", "Hello!"}, {"user", "Bye"}};
  EXPECT_EQ(render_chat(t.chat_template(), turns, true, {{"bos_token", "<bos>"}}),
            "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
            "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n");
  // Roles must alternate: the template raises.
  expect_error([&] { apply_chat_template(t, {{"user", "a"}, {"user", "b"}}, true); },
               "Conversation roles must alternate user/assistant/user/assistant/...");
}

// ------------------------------------------------------------------------------------------- Qwen3.5

TEST(ChatTemplate, Qwen35) {
  std::vector<ChatMessage> msgs = {{"system", "You are helpful."}, {"user", "Hi"}};
  // Thinking is on by default: the generation prompt opens a think block.
  EXPECT_EQ(render_chat(kQwen35Template, msgs, true),
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n");
  EXPECT_EQ(render_chat(kQwen35Template, msgs, true, {{"enable_thinking", false}}),
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n");
  // History: old reasoning dropped; the turn after the last query keeps it.
  std::vector<ChatMessage> h = {{"user", "Hi"},
                                {"assistant", "<think>\ngreeting\n</think>\n\nHello!"},
                                {"user", "2+2?"},
                                {"assistant", "<think>\nadd\n</think>\n\n4"}};
  EXPECT_EQ(render_chat(kQwen35Template, h, false),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nadd\n</think>\n\n4<|im_end|>\n");
  // Content given as a list of parts.
  ChatMessage parts{"user", "", ojson::parse(R"({"content": [{"type": "text", "text": "Look "},
      {"type": "image"}, {"type": "text", "text": "here"}]})")};
  EXPECT_EQ(render_chat(kQwen35Template, {parts}, true, {{"enable_thinking", false}}),
            "<|im_start|>user\nLook <|vision_start|><|image_pad|><|vision_end|>here<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n");
  expect_error([&] { render_chat(kQwen35Template, {{"system", "x"}}, true); }, "No user query found in messages.");
  // Tools are rendered (not parsed); this must not fail.
  std::string withtools = render_chat(kQwen35Template, msgs, true, {{"tools", ojson::array({weather_tool()})}});
  EXPECT_NE(withtools.find("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""), std::string::npos);
  EXPECT_NE(withtools.find("</IMPORTANT>\n\nYou are helpful.<|im_end|>\n"), std::string::npos);
  // Tool call arguments become <parameter=...> blocks.
  ChatMessage call{"assistant", "", ojson::parse(R"({"tool_calls": [{"function":
      {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]})")};
  std::string tc = render_chat(kQwen35Template, {{"user", "Weather?"}, call, {"tool", "sunny"}}, true,
                               {{"enable_thinking", false}});
  EXPECT_EQ(tc,
            "<|im_start|>user\nWeather?<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
            "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

// --------------------------------------------------------------------------------------------- Gemma 4

TEST(ChatTemplate, Gemma4) {
  std::vector<ChatMessage> msgs = {{"system", "You are helpful."}, {"user", "Hi"}};
  // Thinking off: an empty thought channel is pre-filled after the model turn opener.
  EXPECT_EQ(render_chat(kGemma4Template, msgs, true, {{"bos_token", "<bos>"}, {"enable_thinking", false}}),
            "<bos><|turn>system\nYou are helpful.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
            "<|channel>thought\n<channel|>");
  // Thinking on: <|think|> opens the system turn; the model turn is left open.
  EXPECT_EQ(render_chat(kGemma4Template, msgs, true, {{"bos_token", "<bos>"}, {"enable_thinking", true}}),
            "<bos><|turn>system\n<|think|>\nYou are helpful.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n");
  // No system message and thinking off: no system turn at all.
  std::vector<ChatMessage> turns = {{"user", " Hi "}, {"assistant", "Hello!"}, {"user", "Bye"}};
  EXPECT_EQ(render_chat(kGemma4Template, turns, true, {{"bos_token", "<bos>"}}),
            "<bos><|turn>user\nHi<turn|>\n<|turn>model\nHello!<turn|>\n<|turn>user\nBye<turn|>\n<|turn>model\n"
            "<|channel>thought\n<channel|>");
  // A previous model turn's thinking is stripped from the history.
  std::vector<ChatMessage> th = {{"user", "Q"}, {"assistant", "<|channel>thought\nhmm<channel|>Answer"}, {"user", "Q2"}};
  EXPECT_EQ(render_chat(kGemma4Template, th, false, {{"bos_token", "<bos>"}}),
            "<bos><|turn>user\nQ<turn|>\n<|turn>model\nAnswer<turn|>\n<|turn>user\nQ2<turn|>\n");
  // Tool declarations in Gemma 4's own notation.
  EXPECT_EQ(render_chat(kGemma4Template, msgs, false, {{"bos_token", "<bos>"}, {"tools", ojson::array({weather_tool()})}}),
            "<bos><|turn>system\nYou are helpful.<|tool>declaration:get_weather{description:<|\"|>Get weather<|\"|>,"
            "parameters:{properties:{city:{description:<|\"|>City name<|\"|>,type:<|\"|>STRING<|\"|>}},"
            "required:[<|\"|>city<|\"|>],type:<|\"|>OBJECT<|\"|>}}<tool|><turn|>\n<|turn>user\nHi<turn|>\n");
}

// The tiny Gemma 4 model's tokenizer has no template: apply_chat_template falls back to ChatML.
TEST(ChatTemplate, FallbackChatML) {
  const Tokenizer& t = tok("gemma4-tiny/gemma4-tiny-f32.gguf");
  EXPECT_TRUE(t.chat_template().empty());
  EXPECT_EQ(apply_chat_template(t, {{"user", "Hi"}}, true), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

// ------------------------------------------------------------------------------------ the interpreter

TEST(Jinja, WhitespaceControl) {
  // trim_blocks + lstrip_blocks, as transformers configures Jinja for chat templates.
  EXPECT_EQ(render("{% if true %}\n  yes\n{% endif %}\nend", "{}"), "  yes\nend");
  EXPECT_EQ(render("a\n    {% if true %}\nb\n    {% endif %}\nc", "{}"), "a\nb\nc");
  EXPECT_EQ(render("a  {{- 'b' -}}  \n c", "{}"), "abc");
  EXPECT_EQ(render("x {%- if true -%} y {%- endif -%} z", "{}"), "xyz");
  EXPECT_EQ(render("a {# comment #} b", "{}"), "a  b");
  EXPECT_EQ(render("  {#- c -#}  b", "{}"), "b");
  EXPECT_EQ(render("{{ 'a' }}\n{{ 'b' }}", "{}"), "a\nb");  // no trimming after {{ }}
  EXPECT_EQ(render("  {%+ if true %}x{% endif %}", "{}"), "  x");
  EXPECT_EQ(render("{% raw %}{{ not evaluated }}{% endraw %}", "{}"), "{{ not evaluated }}");
}

TEST(Jinja, LoopsAndScopes) {
  EXPECT_EQ(render("{% for x in xs %}{{ loop.index }}{{ x }}{% if not loop.last %},{% endif %}{% endfor %}",
                   R"({"xs": ["a", "b", "c"]})"),
            "1a,2b,3c");
  EXPECT_EQ(render("{% for x in xs %}{{ loop.index0 }}{{ loop.revindex }}{{ loop.first }}{% endfor %}", R"({"xs": [5, 6]})"),
            "02True11False");
  EXPECT_EQ(render("{% for x in xs %}{{ loop.previtem }}>{{ x }}<{{ loop.nextitem }}|{% endfor %}", R"({"xs": [1, 2, 3]})"),
            ">1<2|1>2<3|2>3<|");
  EXPECT_EQ(render("{% for x in [] %}x{% else %}empty{% endfor %}", "{}"), "empty");
  EXPECT_EQ(render("{% for x in range(10) if x is odd %}{{ x }}{% endfor %}", "{}"), "13579");
  EXPECT_EQ(render("{% for x in range(10) %}{% if x == 3 %}{% break %}{% endif %}{% if x == 1 %}{% continue %}{% endif %}{{ x }}{% endfor %}", "{}"),
            "02");
  EXPECT_EQ(render("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}", R"({"d": {"b": 1, "a": 2}})"), "b=1;a=2;");
  EXPECT_EQ(render("{% for k, v in d|dictsort %}{{ k }}={{ v }};{% endfor %}", R"({"d": {"b": 1, "A": 2}})"), "A=2;b=1;");
  // set inside a loop does not leak; namespace() does.
  EXPECT_EQ(render("{% set x = 0 %}{% for i in range(3) %}{% set x = i %}{% endfor %}{{ x }}", "{}"), "0");
  EXPECT_EQ(render("{% set ns = namespace(x=0) %}{% for i in range(3) %}{% set ns.x = ns.x + i %}{% endfor %}{{ ns.x }}", "{}"),
            "3");
  EXPECT_EQ(render("{% for x in xs %}{{ loop.cycle('a', 'b') }}{% endfor %}", R"({"xs": [1, 2, 3]})"), "aba");
  EXPECT_EQ(render("{% set a, b = 1, 2 %}{{ a }}{{ b }}", "{}"), "12");
  EXPECT_EQ(render("{% set s %}in{{ 1 + 1 }}{% endset %}[{{ s }}]", "{}"), "[in2]");
}

TEST(Jinja, ExpressionsAndFilters) {
  EXPECT_EQ(render("{{ 1 + 2 * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 7 / 2 }}", "{}"),
            "7 3 -4 1 2 1024 3.5");
  EXPECT_EQ(render("{{ 'a' ~ 1 ~ none ~ true }} {{ 'ab' * 3 }} {{ [1] + [2] }}", "{}"), "a1NoneTrue ababab [1, 2]");
  EXPECT_EQ(render("{{ 1 < 2 < 3 }} {{ 3 > 2 > 5 }} {{ 'b' in 'abc' }} {{ 4 not in [1, 2] }} {{ 'k' in {'k': 1} }}", "{}"),
            "True False True True True");
  EXPECT_EQ(render("{{ 'yes' if x else 'no' }}{{ 'z' if false }}", R"({"x": 1})"), "yes");
  EXPECT_EQ(render("{{ xs[::-1] }} {{ xs[1:] }} {{ xs[:-1] }} {{ xs[-1] }} {{ 'hello'[1:3] }} {{ 'héllo'[::-1] }}",
                   R"({"xs": [1, 2, 3]})"),
            "[3, 2, 1] [2, 3] [1, 2] 3 el olléh");
  EXPECT_EQ(render("{{ '  hi  '|trim }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'x\n'.rstrip('\n') }}", "{}"),
            "hi|['a', 'b', '', 'c']|['a', 'b']|x");
  EXPECT_EQ(render("{{ 'Hello'|upper }}{{ 'Hello'|lower }}{{ 'hello world'|title }}{{ 'hello'|capitalize }}", "{}"),
            "HELLOhelloHello WorldHello");
  EXPECT_EQ(render("{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith(('x', 'c')) }}{{ 'aXbX'.replace('X', '-') }}", "{}"),
            "TrueTrue" "a-b-");
  EXPECT_EQ(render("{{ xs|length }}{{ 'héllo'|length }}{{ xs|first }}{{ xs|last }}{{ xs|join('-') }}{{ xs|sum }}{{ xs|max }}",
                   R"({"xs": [3, 1, 2]})"),
            "35323-1-263");
  EXPECT_EQ(render("{{ xs|sort }}{{ xs|reverse|list }}{{ xs|unique|list }}", R"({"xs": [3, 1, 3]})"), "[1, 3, 3][3, 1, 3][3, 1]");
  EXPECT_EQ(render("{{ users|selectattr('admin')|map(attribute='name')|join(',') }}|"
                   "{{ users|rejectattr('admin')|map(attribute='name')|list }}|{{ [1, 2, 3, 4]|select('even')|list }}",
                   R"({"users": [{"name": "a", "admin": true}, {"name": "b", "admin": false}, {"name": "c", "admin": true}]})"),
            "a,c|['b']|[2, 4]");
  EXPECT_EQ(render("{{ ['a', 'b']|map('upper')|list }}{{ x|default('d') }}{{ ''|default('e', true) }}{{ none|string }}", "{}"),
            "['A', 'B']deNone");
  EXPECT_EQ(render("{{ d|tojson }}", R"({"d": {"b": [1, 2.5, null, true], "a": "x\"y\n\u00e9"}})"),
            "{\"b\": [1, 2.5, null, true], \"a\": \"x\\\"y\\n\xc3\xa9\"}");
  EXPECT_EQ(render("{{ d|tojson(indent=2) }}", R"({"d": {"a": [1]}})"), "{\n  \"a\": [\n    1\n  ]\n}");
  EXPECT_EQ(render("{{ 1.0 }} {{ 0.1 + 0.2 }} {{ 1e20 }} {{ 1.5e-7 }} {{ 3|float }} {{ '42'|int + 1 }} {{ 2.5|round }}", "{}"),
            "1.0 0.30000000000000004 1e+20 1.5e-07 3.0 43 2.0");  // Python rounds half to even
  EXPECT_EQ(render("{{ {'a': 1, 'b': 'x'} }} {{ [none, true, 'q'] }} {{ \"it's\" }}", "{}"),
            "{'a': 1, 'b': 'x'} [None, True, 'q'] it's");
  EXPECT_EQ(render("{{ d.get('a') }}{{ d.get('z', 'dflt') }}{{ d['a'] }}{{ d.a }}{{ d.missing is defined }}", R"({"d": {"a": 1}})"),
            "1dflt11False");
  EXPECT_EQ(render("{{ 'line1\nline2'|indent(2) }}", "{}"), "line1\n  line2");
}

TEST(Jinja, Tests) {
  EXPECT_EQ(render("{{ x is defined }}{{ y is undefined }}{{ n is none }}{{ s is string }}{{ l is sequence }}"
                   "{{ d is mapping }}{{ l is iterable }}{{ s is not mapping }}{{ b is boolean }}{{ b is true }}"
                   "{{ i is integer }}{{ f is float }}{{ i is number }}{{ 6 is divisibleby 3 }}{{ 'a' is in 'abc' }}",
                   R"({"x": 1, "n": null, "s": "str", "l": [1], "d": {}, "b": true, "i": 3, "f": 1.5})"),
            "TrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrue");
  EXPECT_EQ(render("{{ not x is defined }}{{ x is not defined }}", R"({})"), "TrueTrue");
}

TEST(Jinja, Macros) {
  EXPECT_EQ(render("{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}"
                   "{{ greet('Ann') }} {{ greet('Bob', punct='?') }} {{ greet(punct='.', name='Cy') }}",
                   "{}"),
            "Hi Ann! Hi Bob? Hi Cy.");
  // Recursion (depth-limited), and calling a macro defined later from inside another macro.
  EXPECT_EQ(render("{% macro a(n) %}{{ b(n) }}{% endmacro %}{% macro b(n) %}{% if n > 0 %}{{ n }}{{ a(n - 1) }}{% endif %}{% endmacro %}{{ a(3) }}",
                   "{}"),
            "321");
  expect_error([] { render("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "{}"); }, "recursion");
}

TEST(Jinja, ErrorsNameTheConstruct) {
  expect_error([] { jinja::Template("{% include 'x.jinja' %}"); }, "line 1: unsupported tag 'include'");
  expect_error([] { jinja::Template("a\n{% extends 'base' %}"); }, "line 2: unsupported tag 'extends'");
  expect_error([] { jinja::Template("{{ x|frobnicate }}"); }, "unsupported filter 'frobnicate'");
  expect_error([] { jinja::Template("{{ x is frob }}"); }, "unsupported test 'frob'");
  expect_error([] { jinja::Template("{% if x %}no end"); }, "missing '{% endif %}'");
  expect_error([] { jinja::Template("{% for x in y recursive %}{% endfor %}"); }, "recursive");
  expect_error([] { jinja::Template("{{ 'unterminated }}"); }, "unterminated");
  expect_error([] { render("{{ raise_exception('boom') }}", "{}"); }, "boom");
  expect_error([] { render("{{ undefined_fn() }}", "{}"); }, "'undefined_fn' is undefined");
  expect_error([] { render("{{ 1 + 'a' }}", "{}"); }, "unsupported operand types");
  expect_error([] { render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "{}"); },
               "rendering takes more than 5000000 steps");
}

TEST(Jinja, UndefinedIsLenient) {
  EXPECT_EQ(render("[{{ missing }}][{{ missing.attr }}][{{ missing['k'] }}][{{ missing|length }}]", "{}"), "[][][][0]");
  EXPECT_EQ(render("{% for x in missing %}x{% endfor %}ok", "{}"), "ok");
}

TEST(Jinja, HostileTemplatesFailCleanly) {
  expect_error([] { jinja::Template("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}"); },
               "deeper than 200");
  expect_error([] { jinja::Template("{{ " + std::string(5000, '-') + "1 }}"); }, "deeper than 200");
  std::string ifs;
  for (int i = 0; i < 5000; ++i) ifs += "{% if true %}";
  expect_error([&] { jinja::Template t(ifs); }, "deeper than 200");
  expect_error([] { render("{{ 'x' * 1000000000 }}", "{}"); }, "a string value exceeds 33554432 bytes");
  // Random fragments of template syntax: every one either renders or throws fitmoe::Error.
  const char* bits[] = {"{{", "}}", "{%", "%}", "{#", "#}", "-", "+", " ", "if", "for", "in", "endif", "endfor",
                        "else", "set", "x", "=", "(", ")", "[", "]", "{", "}", "'", "\"", "|", "trim", "is",
                        "defined", "not", "and", ",", ".", ":", "1", "messages", "loop", "macro", "endmacro", "\n"};
  uint64_t s = 12345;
  int rendered = 0;
  for (int n = 0; n < 3000; ++n) {
    std::string t;
    int len = 1 + static_cast<int>(s % 24);
    for (int k = 0; k < len; ++k) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      t += bits[(s >> 33) % (sizeof(bits) / sizeof(*bits))];
    }
    try {
      jinja::Template tp(t);
      tp.render(ojson::parse(R"({"messages": [{"role": "user", "content": "hi"}], "x": [1, 2]})"));
      ++rendered;
    } catch (const Error&) {
    }
  }
  EXPECT_GT(rendered, 0);
}

// A GGUF's template is untrusted: every way to make a render use unbounded memory, time or stack ends in
// a fitmoe::Error naming the bound (the interpreter used to end in std::bad_alloc, the OOM killer, a
// division trap or a stack overflow on these).
TEST(Jinja, RenderIsBoundedInMemory) {
  // Doubling a string 64 times (2^64 bytes), by + and by ~, and a list likewise.
  expect_error([] {
    render("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}", "{}");
  }, "a string value exceeds 33554432 bytes");
  expect_error([] {
    render("{% set ns = namespace(s='xy') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "{}");
  }, "a string value exceeds");
  expect_error([] {
    render("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}", "{}");
  }, "a list exceeds 1048576 items");
  expect_error([] {
    render("{% set l = [0] %}{% for i in range(64) %}{% do l.extend(l) %}{% endfor %}", "{}");
  }, "a list exceeds");
  // Repetition, also with counts whose product with the length wraps around 64 bits.
  expect_error([] { render("{{ [1, 2] * 1000000000 }}", "{}"); }, "a list exceeds");
  expect_error([] { render("{{ 'ab' * 9223372036854775807 }}", "{}"); }, "a string value exceeds");
  expect_error([] { render("{{ 'abcd' * 4611686018427387904 }}", "{}"); }, "a string value exceeds");
  EXPECT_EQ(render("[{{ '' * 9223372036854775807 }}]", "{}"), "[]");
  // Huge joins and replacements.
  expect_error([] { render("{{ range(1000000)|map('string')|join('x' * 1000) }}", "{}"); }, "a string value exceeds");
  expect_error([] { render("{{ ('x' * 1000000)|replace('x', 'y' * 40) }}", "{}"); }, "a string value exceeds");
  expect_error([] { render("{{ 'x'.join(['y' * 1000000] * 100) }}", "{}"); }, "a string value exceeds");
  expect_error([] { render("{{ 'ab'|indent(100000000) }}", "{}"); }, "a string value exceeds");
  // A list holding one list twice, 40 levels deep: 2^40 leaves when printed or dumped as JSON.
  for (const char* print : {"{{ ns.l }}", "{{ ns.l|tojson }}", "{{ ns.l|tojson(indent=2) }}", "{{ ns.l|string|length }}"}) {
    expect_error([&] {
      render(std::string("{% set ns = namespace(l=['x' * 1000]) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}"
                         "{% endfor %}") + print, "{}");
    }, "a string value exceeds");
  }
  // A string copied a few hundred times (each use of a variable is a copy): the bytes made in a render
  // are bounded too.
  expect_error([] {
    render("{% set big = 'x' * 30000000 %}{% for i in range(1000) %}{% if big %}{% endif %}{% endfor %}", "{}");
  }, "rendering makes more than 1073741824 bytes of values");
  // Splitting a long string into a piece per character.
  expect_error([] { render("{{ ('a' * 30000000).split('a')|length }}", "{}"); }, "a list exceeds");
  // The whole output.
  expect_error([] { render("{% for i in range(100) %}{{ 'x' * 1000000 }}{% endfor %}", "{}"); },
               "output exceeds 33554432 bytes");
  jinja::Limits small;
  small.max_output = 10;
  expect_error([&] { jinja::Template("{{ 'hello' }} {{ 'world' }}").render(ojson::object(), small); },
               "output exceeds 10 bytes");
  EXPECT_EQ(jinja::Template("{{ 'hello' }}").render(ojson::object(), small), "hello");
}

TEST(Jinja, RenderIsBoundedInTime) {
  // Loops nested in loops, and builtins that visit many elements per step.
  expect_error([] { render("{% for i in range(3000) %}{% for j in range(3000) %}{{ '' }}{% endfor %}{% endfor %}", "{}"); },
               "steps");
  expect_error([] { render("{{ range(1000000)|unique|list|length }}", "{}"); }, "steps");
  expect_error([] { render("{% for i in range(1000) %}{% if 1 in range(1000000) %}{% endif %}{% endfor %}", "{}"); },
               "steps");
  expect_error([] { render("{% for i in range(100) %}{{ range(1000000)|sort|length }}{% endfor %}", "{}"); }, "steps");
  // Comparing two big strings over and over.
  expect_error([] {
    render("{% set a = 'x' * 10000000 %}{% set l = [a, a] %}{% for i in range(1000) %}{% if l[0] in l[1:] %}{% endif %}"
           "{% endfor %}", "{}");
  }, "bytes");
}

TEST(Jinja, RenderIsBoundedInDepth) {
  // A list nested 100000 levels deep (by a loop, so the parser's bound does not see it): printing it is
  // an error, and freeing it does not overflow the stack.
  const std::string deep =
      "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}{% endfor %}";
  expect_error([&] { render(deep + "{{ ns.l }}", "{}"); }, "values nest deeper than 500 levels");
  expect_error([&] { render(deep + "{{ ns.l|tojson }}", "{}"); }, "values nest deeper than 500 levels");
  expect_error([&] { render(deep + "{{ ns.l == ns.l[0] }}", "{}"); }, "values nest deeper than 500 levels");
  EXPECT_EQ(render(deep + "done", "{}"), "done");
  EXPECT_EQ(render(deep + "{% set ns.l = none %}done", "{}"), "done");
  // A list that holds itself (Python prints [[...]]): an error when printed, no stack overflow.
  expect_error([] { render("{% set l = [] %}{% do l.append(l) %}{{ l }}", "{}"); }, "values nest deeper");
  EXPECT_EQ(render("{% set l = [] %}{% do l.append(l) %}{% set ns = namespace() %}{% set ns.me = ns %}ok", "{}"), "ok");
  // Macros calling macros from deep inside expressions: the interpreter's own recursion is bounded
  // below the stack's size.
  std::string open, close;
  for (int i = 0; i < 25; ++i) open += "[", close += "]";
  const std::string nested = "{% macro f(n) %}{{ " + open + "f(n - 1) if n > 0 else ''" + close + " }}{% endmacro %}";
  EXPECT_NO_THROW(render(nested + "{{ f(10) }}", "{}"));
  expect_error([&] { render(nested + "{{ f(60) }}", "{}"); }, "rendering nests deeper than 1000 levels");
}

TEST(Jinja, ArithmeticAndConversionsFailCleanly) {
  expect_error([] { render("{{ 9223372036854775807 + 1 }}", "{}"); }, "integer overflow in +");
  expect_error([] { render("{{ -9223372036854775807 - 2 }}", "{}"); }, "integer overflow in -");
  expect_error([] { render("{{ 4294967296 * 4294967296 }}", "{}"); }, "integer overflow in *");
  expect_error([] { render("{{ 2 ** 64 }}", "{}"); }, "integer overflow in **");
  expect_error([] { render("{{ (-9223372036854775807 - 1) // -1 }}", "{}"); }, "integer overflow in //");
  expect_error([] { render("{{ (-9223372036854775807 - 1) % -1 }}", "{}"); }, "integer overflow in %");
  expect_error([] { render("{{ -(-9223372036854775807 - 1) }}", "{}"); }, "integer overflow in unary minus");
  expect_error([] { render("{{ 1e300|int }}", "{}"); }, "cannot convert float");
  expect_error([] { render("{{ '1e300'|int }}", "{}"); }, "cannot convert float");
  EXPECT_EQ(render("{{ 2 ** 62 }} {{ (-1) ** 1000001 }} {{ 1 ** 100 }} {{ 0 ** 0 }} {{ 7 // -2 }}", "{}"),
            "4611686018427387904 -1 1 1 -4");
  // Slices and ranges whose step is near 2^63.
  EXPECT_EQ(render("{{ [1, 2, 3][::9223372036854775807] }} {{ [1, 2, 3][::-9223372036854775807 - 1] }}", "{}"), "[1] [3]");
  EXPECT_EQ(render("{{ range(0, 10, 9223372036854775807)|list }} {{ range(5, -10, -9223372036854775807)|list }}", "{}"),
            "[0] [5]");
  // Numbers too long for 64 bits where a field or attribute path is parsed.
  expect_error([] { render("{{ '{99999999999999999999999}'.format(1) }}", "{}"); }, "argument index out of range");
  EXPECT_EQ(render("{{ [[1]]|map(attribute='99999999999999999999')|list|length }}", "{}"), "1");
}
