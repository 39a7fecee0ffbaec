//! PEFT's `rank_pattern` / `alpha_pattern` lookup, in Rust with Python's
//! exact meaning.
//!
//! PEFT (`peft.utils.other.get_pattern_key`) tries the keys in dict order —
//! the order of the JSON file, since `json.load` keeps it — and the first key
//! for which `re.match(rf"(.*\.)?({key})$", module_path)` succeeds wins. Here
//! each key becomes `^(?:.*\.)?(?:key)$` in the `regex` crate, after a scan
//! that rejects the constructs the two engines read differently; a key that
//! fails either step is reported (`REJECT[pattern-regex]`), never guessed.

use regex::Regex;

/// One pattern entry, in file order.
#[derive(Debug, Clone)]
pub struct PatternEntry<T> {
    /// The key as written in the config.
    pub key: String,
    /// The rank or alpha it gives.
    pub value: T,
    regex: Result<Regex, String>,
}

impl<T> PatternEntry<T> {
    /// Why the key cannot be used, when it cannot.
    pub fn error(&self) -> Option<&str> {
        self.regex.as_ref().err().map(String::as_str)
    }
}

/// A `rank_pattern` or `alpha_pattern`: entries in file order.
#[derive(Debug, Clone)]
pub struct PatternTable<T> {
    entries: Vec<PatternEntry<T>>,
}

impl<T> Default for PatternTable<T> {
    fn default() -> Self {
        PatternTable { entries: Vec::new() }
    }
}

impl<T: Copy> PatternTable<T> {
    /// Compile `entries` (already in file order). Keys that cannot be
    /// compiled exactly are kept, with their error, and never match.
    pub fn new(entries: Vec<(String, T)>) -> PatternTable<T> {
        PatternTable {
            entries: entries
                .into_iter()
                .map(|(key, value)| {
                    let regex = peft_pattern_regex(&key);
                    PatternEntry { key, value, regex }
                })
                .collect(),
        }
    }

    /// Every entry in file order.
    pub fn entries(&self) -> &[PatternEntry<T>] {
        &self.entries
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The first entry (file order) whose key matches `module_path`, as PEFT's
    /// `get_pattern_key` picks it: `(key, value)`.
    pub fn lookup(&self, module_path: &str) -> Option<(&str, T)> {
        self.entries.iter().find_map(|e| match &e.regex {
            Ok(re) if re.is_match(module_path) => Some((e.key.as_str(), e.value)),
            _ => None,
        })
    }
}

/// The regex PEFT builds from a pattern key, `(.*\.)?({key})$` anchored at
/// the start like `re.match`, or why it cannot be expressed exactly.
pub fn peft_pattern_regex(key: &str) -> Result<Regex, String> {
    if let Some(why) = python_only_construct(key) {
        return Err(why.to_string());
    }
    Regex::new(&format!(r"^(?:.*\.)?(?:{key})$")).map_err(|e| {
        let msg = e.to_string();
        // The regex crate's messages span several lines; keep the gist.
        let gist = msg.lines().last().unwrap_or(&msg).trim().to_string();
        format!("not a regex the Rust engine can run with Python's meaning: {gist}")
    })
}

/// A construct Python's `re` and the `regex` crate both accept but read
/// differently, or that a module path can never need.
fn python_only_construct(key: &str) -> Option<&'static str> {
    if key.chars().any(char::is_control) {
        return Some("contains a control character");
    }
    let chars: Vec<char> = key.chars().collect();
    let mut i = 0;
    let mut in_class = false;
    let mut class_start = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '\\' {
            if in_class && chars.get(i + 1) == Some(&'b') {
                return Some(r"`\b` in a character class is a backspace in Python only");
            }
            i += 2;
            continue;
        }
        if in_class {
            let first = i == class_start || (i == class_start + 1 && chars[class_start] == '^');
            if c == ']' && !first {
                in_class = false;
            } else if c == '[' {
                return Some("`[` inside a character class: a literal in Python, a nested or POSIX class in Rust");
            } else if matches!(c, '&' | '-' | '~') && chars.get(i + 1) == Some(&c) {
                return Some("`&&`, `--` or `~~` inside a character class: literals in Python, set operations in Rust");
            }
        } else if c == '[' {
            in_class = true;
            class_start = i + 1;
        } else if c == '(' && chars.get(i + 1) == Some(&'?') {
            // Inline flags: verbose mode treats whitespace in classes differently.
            let flags: String = chars[i + 2..]
                .iter()
                .take_while(|ch| ch.is_ascii_alphabetic() || **ch == '-')
                .collect();
            if flags.contains('x') {
                return Some("verbose mode `(?x)` differs between Python and Rust");
            }
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests;
