//! Chat templates: the checkpoint's own Jinja template (GGUF `tokenizer.chat_template` or HF
//! `tokenizer_config.json`), rendered with minijinja the way transformers renders it.

use serde::Serialize;

use crate::error::{Error, Result};

/// ChatML, used when an instruct model ships its special tokens but no template.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's tool calls, as chat templates read them: `[{"type": "function", "function": {"name":
    /// ..., "arguments": {...}}}]` (arguments as an object, not OpenAI's JSON string).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
}

impl ChatMessage {
    pub fn user(content: impl Into<String>) -> Self {
        ChatMessage {
            role: "user".into(),
            content: content.into(),
            tool_calls: None,
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        ChatMessage {
            role: "system".into(),
            content: content.into(),
            tool_calls: None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
}

/// The form in which a chat template asks the model to call tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallForm {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2 / Qwen2.5, Hermes).
    Hermes,
    /// The answer is the call, `{"name": ..., "parameters": {...}}` (Llama 3.1-3.3's JSON tool calling; its
    /// template renders the tools into the first user message).
    LlamaJson,
}

impl ToolCallForm {
    /// The key of a call's arguments in this form.
    pub fn arguments_key(self) -> &'static str {
        match self {
            ToolCallForm::Hermes => "arguments",
            ToolCallForm::LlamaJson => "parameters",
        }
    }
}

impl ChatTemplate {
    pub fn new(source: impl Into<String>) -> Self {
        ChatTemplate {
            source: source.into(),
        }
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders the conversation, ending with the assistant's turn opener when `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt, bos_token, eos_token)
    }

    /// How the template asks for tool calls, where it renders tool definitions (reads `tools`) in a form the
    /// server parses; None for templates without tools or with another form.
    pub fn tool_call_form(&self) -> Option<ToolCallForm> {
        if !self.source.contains("tools") {
            return None;
        }
        if self.source.contains("<tool_call>") {
            Some(ToolCallForm::Hermes)
        } else if self
            .source
            .contains("respond with a JSON for a function call")
            && self.source.contains("\"parameters\"")
        {
            Some(ToolCallForm::LlamaJson)
        } else {
            None
        }
    }

    /// As `render`, with the request's tool definitions (OpenAI's `tools` list) for templates that read them.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String> {
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_function("strftime_now", |fmt: String| -> String {
            format_today(&fmt)
        });
        // A template comes from the model file: bound its work and its output so that a hostile or broken one
        // ends with an error instead of running forever or filling memory.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_template("chat", &self.source).map_err(|e| {
            Error::ChatTemplate(format!("the model's template does not parse: {e}"))
        })?;
        let tmpl = env
            .get_template("chat")
            .map_err(|e| Error::ChatTemplate(e.to_string()))?;
        let mut out = BoundedOutput::default();
        let rendered = tmpl.render_captured_to(
            minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => bos_token,
                eos_token => eos_token,
                tools => tools.map_or(minijinja::Value::UNDEFINED, minijinja::Value::from_serialize),
            },
            &mut out,
        );
        if out.overflowed {
            return Err(Error::ChatTemplate(format!(
                "rendering produced more than {TEMPLATE_MAX_OUTPUT} bytes; the template is broken"
            )));
        }
        rendered.map_err(|e| Error::ChatTemplate(format!("rendering failed: {e}")))?;
        String::from_utf8(out.bytes)
            .map_err(|_| Error::ChatTemplate("rendering produced invalid UTF-8".into()))
    }
}

/// Instructions a template may execute per rendering: real templates use a few hundred per message, so this is
/// ample for any conversation while ending an endless loop within about a second.
const TEMPLATE_FUEL: u64 = 50_000_000;

/// Bytes a rendering may produce: far more text than any model's context holds.
const TEMPLATE_MAX_OUTPUT: usize = 64 << 20;

/// Collects rendered text, failing the write once it passes [`TEMPLATE_MAX_OUTPUT`].
#[derive(Default)]
struct BoundedOutput {
    bytes: Vec<u8>,
    overflowed: bool,
}

impl std::io::Write for BoundedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + buf.len() > TEMPLATE_MAX_OUTPUT {
            self.overflowed = true;
            return Err(std::io::Error::other("template output too large"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `strftime_now` for templates that print today's date (Llama 3.1); supports the common %d %b %Y %m %B.
fn format_today(fmt: &str) -> String {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() / 86_400)
        .unwrap_or(0) as i64;
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let name = MONTHS[(month - 1) as usize];
    fmt.replace("%d", &format!("{day:02}"))
        .replace("%m", &format!("{month:02}"))
        .replace("%Y", &year.to_string())
        .replace("%B", name)
        .replace("%b", &name[..3])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_renders_user_turn_and_generation_prompt() {
        let t = ChatTemplate::new(CHATML_TEMPLATE);
        let s = t.render(&[ChatMessage::user("hi")], true, "", "").unwrap();
        assert_eq!(s, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    }

    /// A template in the form of Llama 3.1's JSON tool calling (tools in the first user message, calls answered
    /// as `{"name": ..., "parameters": ...}`): its form is recognized and the tools reach the prompt.
    #[test]
    fn tool_call_forms_are_recognized_and_tools_rendered() {
        let llama_like = ChatTemplate::new(
            "{%- if tools %}<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please \
             respond with a JSON for a function call with its proper arguments.\nRespond in the format \
             {\"name\": function name, \"parameters\": dictionary of argument name and its value}.\n\n\
             {%- for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}{{ messages[0].content }}<|eot_id|>\
             {%- endif %}<|start_header_id|>assistant<|end_header_id|>\n\n",
        );
        assert_eq!(llama_like.tool_call_form(), Some(ToolCallForm::LlamaJson));
        let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
        let text = llama_like
            .render_with_tools(
                &[ChatMessage::user("Weather in Oslo?")],
                Some(&tools),
                true,
                "",
                "",
            )
            .unwrap();
        assert!(
            text.contains("\"name\": \"get_weather\"") && text.contains("Weather in Oslo?"),
            "{text}"
        );
        let hermes = ChatTemplate::new(
            "{% if tools %}<tools>{{ tools | tojson }}</tools> <tool_call>{% endif %}",
        );
        assert_eq!(hermes.tool_call_form(), Some(ToolCallForm::Hermes));
        assert_eq!(ChatTemplate::new(CHATML_TEMPLATE).tool_call_form(), None);
        assert_eq!(ToolCallForm::LlamaJson.arguments_key(), "parameters");
    }

    #[test]
    fn template_errors_are_reported_not_panicked() {
        let t = ChatTemplate::new("{% if %}");
        assert!(matches!(
            t.render(&[], true, "", ""),
            Err(Error::ChatTemplate(_))
        ));
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}");
        let err = t.render(&[], true, "", "").unwrap_err().to_string();
        assert!(err.contains("no system role"), "{err}");
    }

    /// A template that never ends, or one that prints without bound, stops with an error.
    #[test]
    fn endless_or_huge_templates_end_with_an_error() {
        let endless = ChatTemplate::new(
            "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
        );
        let start = std::time::Instant::now();
        let err = endless.render(&[], true, "", "").unwrap_err().to_string();
        assert!(err.contains("fuel"), "{err}");
        assert!(start.elapsed().as_secs() < 30);
        let huge = ChatTemplate::new("{% for a in range(100) %}{{ 'x' * 10000000 }}{% endfor %}");
        let err = huge.render(&[], true, "", "").unwrap_err().to_string();
        assert!(err.contains("more than"), "{err}");
    }

    #[test]
    fn python_string_methods_work() {
        let t = ChatTemplate::new("{{ messages[0]['content'].strip() }}");
        assert_eq!(
            t.render(&[ChatMessage::user("  x ")], false, "", "")
                .unwrap(),
            "x"
        );
    }
}
