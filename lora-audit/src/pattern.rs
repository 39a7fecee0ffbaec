//! PEFT's `rank_pattern` / `alpha_pattern` lookup, in Rust with Python's
//! exact meaning.
//!
//! PEFT (`peft.utils.other.get_pattern_key`) tries the keys in dict order —
//! the order of the JSON file, since `json.load` keeps it — and the first key
//! for which `re.match(rf"(.*\.)?({key})$", module_path)` succeeds wins.
//!
//! A key is read by a parser of Python's `re` syntax (3.11's `re._parser`)
//! that accepts only a whitelisted subset and translates it token by token
//! into the `regex` crate's syntax (every literal escaped), so no construct
//! can mean one thing to Python and another to Rust. Everything else is
//! refused with a reason (`REJECT[pattern-regex]`), never guessed:
//!
//! - accepted: literals (`\`-escaped ASCII punctuation, `\x41`, `\u0041`,
//!   `\U00000041`, `\a \f \n \r \t \v`), `.`, `^`, `$`, `\A`, `\Z`, `\b`,
//!   `\B`, `\d \D \w \W \s \S`, classes `[...]` (ranges, negation, the
//!   category escapes), groups `(...)`, `(?:...)`, `(?P<name>...)` (ASCII
//!   names), `|`, and the greedy or lazy quantifiers `* + ? {m} {m,} {,n}
//!   {m,n}` (counts up to [`MAX_REPEAT`]); a `{` that is not a quantifier is
//!   a literal, as in Python;
//! - refused because Python's `re` rejects them (PEFT would raise, never
//!   apply them): global inline flags (`(?i)Q_PROJ`: inside PEFT's
//!   wrapper they are never at the start), `\x{71}`, `\z`, `\p{..}`, `\Q`,
//!   `\e`, `\h`, `(?<name>..)`, nothing or a repeat to repeat, bad ranges,
//!   unbalanced parentheses;
//! - refused because Rust cannot run them with Python's meaning: look-around,
//!   back-references and octal escapes, atomic groups, possessive
//!   quantifiers, conditionals, comments `(?#..)`, scoped inline flags
//!   (`(?i:..)`: case folding differs), `\N{..}`, surrogates, and the class
//!   forms Python warns may change meaning (`[[`, `&&`, `--`, `~~`, `||`)
//!   and `[\b]`; control characters anywhere.
//!
//! The categories (`\d \w \s \b` and their negations) agree between the two
//! engines on printable ASCII, which is all a module path holds (the audit
//! refuses other tensor names, `REJECT[unknown-key]`); Python's `$` also
//! matches before a final newline, which a module path never has.
//!
//! Lookup cost: keys made only of literals and `.` ("plain" keys, what
//! tools write: full module paths) live in one reversed trie walked once
//! per lookup from the path's end; the others are compiled regexes, at most
//! [`MAX_REGEX_PATTERN_KEYS`] per table, tried in file order only while they
//! could still beat the trie's answer. A config with the largest allowed
//! tables ([`MAX_PATTERN_KEYS`]) builds in linear time.

use std::collections::{HashMap, HashSet};

use regex::{Regex, RegexBuilder};

/// The most distinct keys a `rank_pattern` or `alpha_pattern` may have
/// (65,536: one per module of a transformers 4.x per-expert adapter of the
/// largest MoE models, e.g. DeepSeek-V3's 45k). More is
/// [`AuditError::PatternLimit`](crate::AuditError::PatternLimit).
pub const MAX_PATTERN_KEYS: usize = 1 << 16;

/// The most keys per table that need a compiled regex (keys other than
/// literals and `.`); further ones are refused (`REJECT[pattern-regex]`).
/// Each lookup may try them all, so they are few by design.
pub const MAX_REGEX_PATTERN_KEYS: usize = 256;

/// The longest pattern key accepted, in bytes.
pub const MAX_PATTERN_KEY_BYTES: usize = 4096;

/// The largest repetition count accepted in a key (`{m,n}`).
pub const MAX_REPEAT: u32 = 1000;

/// Deepest group nesting accepted in a key.
const MAX_NESTING: usize = 32;

/// Compiled-program and lazy-DFA bounds of one key's regex.
const REGEX_SIZE_LIMIT: usize = 1 << 18;

/// One pattern entry, in file order.
#[derive(Debug, Clone)]
pub struct PatternEntry<T> {
    /// The key as written in the config.
    pub key: String,
    /// The rank or alpha it gives.
    pub value: T,
    matcher: Result<Matcher, String>,
}

#[derive(Debug, Clone)]
enum Matcher {
    /// Literals and `.` only: matched by the table's trie.
    Plain,
    /// Anything else the subset accepts.
    Regex(Regex),
}

impl<T> PatternEntry<T> {
    /// Why the key cannot be used, when it cannot.
    pub fn error(&self) -> Option<&str> {
        self.matcher.as_ref().err().map(String::as_str)
    }
}

/// A `rank_pattern` or `alpha_pattern`: entries in file order.
#[derive(Debug, Clone)]
pub struct PatternTable<T> {
    entries: Vec<PatternEntry<T>>,
    plain: PlainTrie,
    /// Indices of the entries with a compiled regex, ascending.
    regex_ids: Vec<usize>,
}

impl<T> Default for PatternTable<T> {
    fn default() -> Self {
        PatternTable {
            entries: Vec::new(),
            plain: PlainTrie::new(),
            regex_ids: Vec::new(),
        }
    }
}

impl<T: Copy> PatternTable<T> {
    /// Compile `entries` (already in file order). Keys that cannot be
    /// compiled exactly are kept, with their error, and never match; so are
    /// regex keys past [`MAX_REGEX_PATTERN_KEYS`]. Linear in the keys' size.
    pub fn new(entries: Vec<(String, T)>) -> PatternTable<T> {
        let mut table = PatternTable::default();
        for (i, (key, value)) in entries.into_iter().enumerate() {
            let matcher = match translate(&key) {
                Err(why) => Err(why),
                Ok(Translation { plain: Some(atoms), .. }) => {
                    table.plain.insert(&atoms, i);
                    Ok(Matcher::Plain)
                }
                Ok(_) if table.regex_ids.len() >= MAX_REGEX_PATTERN_KEYS => Err(format!(
                    "the table already has {MAX_REGEX_PATTERN_KEYS} keys that need a regex \
                     (MAX_REGEX_PATTERN_KEYS); keys of literals and `.` are not limited so"
                )),
                Ok(Translation { rust, .. }) => compile(&rust).map(Matcher::Regex),
            };
            if matches!(matcher, Ok(Matcher::Regex(_))) {
                table.regex_ids.push(i);
            }
            table.entries.push(PatternEntry { key, value, matcher });
        }
        table
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
    /// `get_pattern_key` picks it: `(key, value)`. Exact for module paths of
    /// printable ASCII (see the module docs).
    pub fn lookup(&self, module_path: &str) -> Option<(&str, T)> {
        let mut best = self.plain.first_match(module_path);
        for &i in &self.regex_ids {
            if best.is_some_and(|b| i >= b) {
                break;
            }
            if let Some(PatternEntry {
                matcher: Ok(Matcher::Regex(re)),
                ..
            }) = self.entries.get(i)
                && re.is_match(module_path)
            {
                best = Some(i);
                break;
            }
        }
        let e = self.entries.get(best?)?;
        Some((e.key.as_str(), e.value))
    }
}

/// The regex PEFT builds from a pattern key, `(.*\.)?({key})$` anchored at
/// the start like `re.match`, in the `regex` crate's syntax, or why it
/// cannot be expressed exactly (see the module docs for the accepted
/// subset of Python's `re`).
pub fn peft_pattern_regex(key: &str) -> Result<Regex, String> {
    compile(&translate(key)?.rust)
}

fn compile(rust: &str) -> Result<Regex, String> {
    RegexBuilder::new(&format!(r"^(?:.*\.)?(?:{rust})$"))
        .size_limit(REGEX_SIZE_LIMIT)
        .dfa_size_limit(REGEX_SIZE_LIMIT)
        .build()
        .map_err(|e| {
            let msg = e.to_string();
            // The regex crate's messages span several lines; keep the gist.
            let gist = msg.lines().last().unwrap_or(&msg).trim().to_string();
            format!("the Rust regex engine cannot run it: {gist}")
        })
}

// --- the Python `re` subset -------------------------------------------------------------------

/// One element of a plain key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Atom {
    /// This character.
    Lit(char),
    /// `.`: any character but `\n`.
    Any,
}

/// A key in the `regex` crate's syntax, and its atoms when it is plain.
struct Translation {
    rust: String,
    plain: Option<Vec<Atom>>,
}

/// What the last item of a sequence was, for Python's repeat rules.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Last {
    /// Nothing yet (start, after `|` or `(`): "nothing to repeat".
    Nothing,
    /// An anchor (`^ $ \A \Z \b \B`): "nothing to repeat".
    Anchor,
    /// A quantified item: "multiple repeat".
    Repeat,
    /// Anything repeatable.
    Item,
}

/// What one escape outside a class means.
enum Escape {
    Literal(char),
    /// A category (`\d`, ...), in Rust syntax.
    Category(&'static str),
    /// An anchor, in Rust syntax.
    Anchor(&'static str),
}

/// One element of a class.
enum ClassItem {
    Literal(char),
    Category(&'static str),
    Range(char, char),
}

fn translate(key: &str) -> Result<Translation, String> {
    if key.len() > MAX_PATTERN_KEY_BYTES {
        return Err(format!(
            "{} bytes, over the limit of {MAX_PATTERN_KEY_BYTES} (MAX_PATTERN_KEY_BYTES)",
            key.len()
        ));
    }
    if key.chars().any(char::is_control) {
        return Err("contains a control character".into());
    }
    let mut p = Parser {
        chars: key.chars().collect(),
        pos: 0,
        out: String::with_capacity(key.len() + 8),
        names: HashSet::new(),
        atoms: Some(Vec::new()),
    };
    p.alternation(0)?;
    if p.pos < p.chars.len() {
        // Only an unmatched `)` stops the top level early.
        return Err("Python's re rejects it: unbalanced parenthesis".into());
    }
    Ok(Translation {
        rust: p.out,
        plain: p.atoms,
    })
}

fn python_error(what: &str) -> String {
    format!("Python's re rejects it ({what}), so PEFT would never apply it")
}

fn unsupported(what: &str) -> String {
    format!("{what}: Python accepts it, but the Rust regex engine cannot reproduce its meaning")
}

struct Parser {
    chars: Vec<char>,
    pos: usize,
    out: String,
    names: HashSet<String>,
    /// The key's atoms while it is plain (literals and `.` at top level).
    atoms: Option<Vec<Atom>>,
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn peek_at(&self, ahead: usize) -> Option<char> {
        self.chars.get(self.pos + ahead).copied()
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn not_plain(&mut self) {
        self.atoms = None;
    }

    fn atom(&mut self, atom: Atom) {
        if let Some(atoms) = &mut self.atoms {
            atoms.push(atom);
        }
    }

    /// A literal character, escaped for the `regex` crate.
    fn emit_literal(&mut self, c: char) {
        if c.is_ascii_alphanumeric() || c == '_' {
            self.out.push(c);
        } else {
            self.out.push_str(&format!("\\x{{{:X}}}", c as u32));
        }
    }

    /// `a|b|...` up to `)` or the end.
    fn alternation(&mut self, depth: usize) -> Result<(), String> {
        loop {
            self.sequence(depth)?;
            if self.eat('|') {
                self.not_plain();
                self.out.push('|');
            } else {
                return Ok(());
            }
        }
    }

    /// Items up to `|`, `)` or the end.
    fn sequence(&mut self, depth: usize) -> Result<(), String> {
        let mut last = Last::Nothing;
        while let Some(c) = self.peek() {
            match c {
                '|' | ')' => return Ok(()),
                '(' => {
                    self.group(depth)?;
                    last = Last::Item;
                }
                '[' => {
                    self.class()?;
                    last = Last::Item;
                }
                '.' => {
                    self.pos += 1;
                    self.out.push('.');
                    self.atom(Atom::Any);
                    last = Last::Item;
                }
                '^' | '$' => {
                    self.pos += 1;
                    self.not_plain();
                    self.out.push(c);
                    last = Last::Anchor;
                }
                '\\' => {
                    self.pos += 1;
                    match self.escape()? {
                        Escape::Literal(l) => {
                            self.emit_literal(l);
                            self.atom(Atom::Lit(l));
                            last = Last::Item;
                        }
                        Escape::Category(rust) => {
                            self.not_plain();
                            self.out.push_str(rust);
                            last = Last::Item;
                        }
                        Escape::Anchor(rust) => {
                            self.not_plain();
                            self.out.push_str(rust);
                            last = Last::Anchor;
                        }
                    }
                }
                '*' | '+' | '?' => {
                    self.pos += 1;
                    self.repeat(last, &c.to_string())?;
                    last = Last::Repeat;
                }
                '{' => match self.braces()? {
                    Some(rust) => {
                        self.repeat(last, &rust)?;
                        last = Last::Repeat;
                    }
                    None => {
                        // Not a quantifier: a literal `{`, as in Python.
                        self.emit_literal('{');
                        self.atom(Atom::Lit('{'));
                        last = Last::Item;
                    }
                },
                _ => {
                    self.pos += 1;
                    self.emit_literal(c);
                    self.atom(Atom::Lit(c));
                    last = Last::Item;
                }
            }
        }
        Ok(())
    }

    /// After `*`, `+`, `?` or `{m,n}` (already consumed): Python's checks,
    /// then an optional lazy `?`; a possessive `+` is refused.
    fn repeat(&mut self, last: Last, rust: &str) -> Result<(), String> {
        match last {
            Last::Nothing | Last::Anchor => return Err(python_error("nothing to repeat")),
            Last::Repeat => return Err(python_error("multiple repeat")),
            Last::Item => {}
        }
        self.not_plain();
        self.out.push_str(rust);
        if self.eat('?') {
            self.out.push('?');
        } else if self.peek() == Some('+') {
            return Err(unsupported("a possessive quantifier (Python 3.11+)"));
        }
        Ok(())
    }

    /// At `{`: a quantifier in Rust syntax by Python's rules, consumed; or
    /// `None` (nothing consumed but the `{`) when it is a literal `{`.
    fn braces(&mut self) -> Result<Option<String>, String> {
        let here = self.pos;
        self.pos += 1;
        if self.peek() == Some('}') {
            return Ok(None);
        }
        let digits = |p: &mut Parser| {
            let start = p.pos;
            while p.peek().is_some_and(|c| c.is_ascii_digit()) {
                p.pos += 1;
            }
            p.chars[start..p.pos].iter().collect::<String>()
        };
        let lo = digits(self);
        let hi = if self.eat(',') { Some(digits(self)) } else { None };
        if !self.eat('}') {
            self.pos = here + 1;
            return Ok(None);
        }
        let count = |s: &str| -> Result<Option<u32>, String> {
            if s.is_empty() {
                return Ok(None);
            }
            match s.parse::<u32>() {
                Ok(n) if n <= MAX_REPEAT => Ok(Some(n)),
                _ => Err(format!("a repetition count of {s}, over {MAX_REPEAT} (MAX_REPEAT)")),
            }
        };
        let min = count(&lo)?.unwrap_or(0);
        let rust = match hi {
            None => format!("{{{min}}}"),
            Some(hi) => match count(&hi)? {
                None => format!("{{{min},}}"),
                Some(max) if max < min => return Err(python_error("min repeat greater than max repeat")),
                Some(max) => format!("{{{min},{max}}}"),
            },
        };
        Ok(Some(rust))
    }

    /// At `(`.
    fn group(&mut self, depth: usize) -> Result<(), String> {
        if depth >= MAX_NESTING {
            return Err(format!("groups nested deeper than {MAX_NESTING}"));
        }
        self.not_plain();
        self.pos += 1;
        if self.eat('?') {
            match self.peek() {
                Some(':') => self.pos += 1,
                Some('P') => {
                    self.pos += 1;
                    match self.peek() {
                        Some('<') => {
                            self.pos += 1;
                            self.group_name()?;
                        }
                        Some('=') => return Err(unsupported("a back-reference `(?P=name)`")),
                        _ => return Err(python_error("unknown extension")),
                    }
                }
                Some('=') | Some('!') => return Err(unsupported("a look-ahead")),
                Some('<') => match self.peek_at(1) {
                    Some('=') | Some('!') => return Err(unsupported("a look-behind")),
                    _ => return Err(python_error("`(?<name>` is not Python 3.11 syntax; use `(?P<name>`")),
                },
                Some('#') => return Err(unsupported("a comment group")),
                Some('>') => return Err(unsupported("an atomic group (Python 3.11+)")),
                Some('(') => return Err(unsupported("a conditional group")),
                Some(c) if c.is_ascii_alphabetic() || c == '-' => {
                    return Err(
                        "inline flags are refused: a global flag such as `(?i)` is an error inside PEFT's \
                         `(.*\\.)?(key)$` (Python: global flags not at the start), and scoped flags \
                         `(?i:...)` fold case differently in the two engines"
                            .into(),
                    );
                }
                _ => return Err(python_error("unknown extension")),
            }
        }
        self.out.push_str("(?:");
        self.alternation(depth + 1)?;
        if !self.eat(')') {
            return Err(python_error("missing ), unterminated subpattern"));
        }
        self.out.push(')');
        Ok(())
    }

    /// After `(?P<`: an ASCII identifier, `>`, not used before.
    fn group_name(&mut self) -> Result<(), String> {
        let start = self.pos;
        while self.peek().is_some_and(|c| c != '>') {
            self.pos += 1;
        }
        let name: String = self.chars[start..self.pos].iter().collect();
        if !self.eat('>') {
            return Err(python_error("missing >, unterminated name"));
        }
        let mut chars = name.chars();
        let ident = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ident {
            return Err(format!(
                "group name `{name}`: only ASCII identifiers are accepted (Python rejects other non-identifiers)"
            ));
        }
        if !self.names.insert(name.clone()) {
            return Err(python_error(&format!("redefinition of group name `{name}`")));
        }
        Ok(())
    }

    /// After a `\` outside a class.
    fn escape(&mut self) -> Result<Escape, String> {
        let Some(c) = self.peek() else {
            return Err(python_error("bad escape (end of pattern)"));
        };
        self.pos += 1;
        Ok(match c {
            'd' => Escape::Category(r"\d"),
            'D' => Escape::Category(r"\D"),
            'w' => Escape::Category(r"\w"),
            'W' => Escape::Category(r"\W"),
            's' => Escape::Category(r"\s"),
            'S' => Escape::Category(r"\S"),
            'A' => Escape::Anchor(r"\A"),
            'Z' => Escape::Anchor(r"\z"),
            'b' => Escape::Anchor(r"\b"),
            'B' => Escape::Anchor(r"\B"),
            _ => Escape::Literal(self.literal_escape(c)?),
        })
    }

    /// The character of a literal escape `\c` (after `c`), inside or
    /// outside a class.
    fn literal_escape(&mut self, c: char) -> Result<char, String> {
        match c {
            'a' => Ok('\x07'),
            'f' => Ok('\x0C'),
            'n' => Ok('\n'),
            'r' => Ok('\r'),
            't' => Ok('\t'),
            'v' => Ok('\x0B'),
            'x' => self.hex(2, 'x'),
            'u' => self.hex(4, 'u'),
            'U' => self.hex(8, 'U'),
            'N' => Err(unsupported("a named character `\\N{...}`")),
            '0'..='9' => Err(unsupported("a back-reference or octal escape")),
            c if c.is_ascii_alphabetic() => Err(python_error(&format!("bad escape \\{c}"))),
            c => Ok(c),
        }
    }

    /// Exactly `n` hex digits (Python's `\x`, `\u`, `\U`), as a character.
    fn hex(&mut self, n: usize, which: char) -> Result<char, String> {
        let digits: String = self.chars[self.pos..]
            .iter()
            .take(n)
            .take_while(|c| c.is_ascii_hexdigit())
            .collect();
        if digits.len() != n {
            return Err(python_error(&format!("incomplete escape \\{which}{digits}")));
        }
        self.pos += n;
        let code = u32::from_str_radix(&digits, 16).map_err(|_| python_error("bad escape"))?;
        if code > 0x10FFFF {
            return Err(python_error(&format!("bad escape \\{which}{digits}")));
        }
        char::from_u32(code).ok_or_else(|| unsupported(&format!("a surrogate code point \\{which}{digits}")))
    }

    /// At `[`: Python's class rules (3.11 `re._parser`), emitted with every
    /// literal escaped.
    fn class(&mut self) -> Result<(), String> {
        self.not_plain();
        self.pos += 1;
        if self.peek() == Some('[') {
            return Err(unsupported(
                "`[` first in a class (Python warns it may become a nested set; Rust reads `[[:alpha:]]` as POSIX)",
            ));
        }
        let negate = self.eat('^');
        let mut items: Vec<ClassItem> = Vec::new();
        loop {
            let Some(this) = self.peek() else {
                return Err(python_error("unterminated character set"));
            };
            self.pos += 1;
            if this == ']' && !items.is_empty() {
                break;
            }
            let first = self.class_item(this, !items.is_empty())?;
            if self.eat('-') {
                let Some(that) = self.peek() else {
                    return Err(python_error("unterminated character set"));
                };
                self.pos += 1;
                if that == ']' {
                    items.push(first);
                    items.push(ClassItem::Literal('-'));
                    break;
                }
                if that == '-' {
                    return Err(unsupported(
                        "`--` in a class (Python warns it may become a set difference)",
                    ));
                }
                let second = self.class_item(that, true)?;
                match (first, second) {
                    (ClassItem::Literal(lo), ClassItem::Literal(hi)) if lo <= hi => {
                        items.push(ClassItem::Range(lo, hi));
                    }
                    _ => return Err(python_error("bad character range")),
                }
            } else {
                items.push(first);
            }
        }
        self.out.push('[');
        if negate {
            self.out.push('^');
        }
        for item in items {
            match item {
                ClassItem::Literal(c) => self.out.push_str(&format!("\\x{{{:X}}}", c as u32)),
                ClassItem::Range(lo, hi) => {
                    self.out
                        .push_str(&format!("\\x{{{:X}}}-\\x{{{:X}}}", lo as u32, hi as u32));
                }
                ClassItem::Category(rust) => self.out.push_str(rust),
            }
        }
        self.out.push(']');
        Ok(())
    }

    /// One class element starting with `this` (consumed); `nonempty` when
    /// the class already has an element.
    fn class_item(&mut self, this: char, nonempty: bool) -> Result<ClassItem, String> {
        if this != '\\' {
            if nonempty && "-&~|".contains(this) && self.peek() == Some(this) {
                return Err(unsupported(&format!(
                    "`{this}{this}` in a class (Python warns it may become a set operation; Rust reads some as one)"
                )));
            }
            return Ok(ClassItem::Literal(this));
        }
        let Some(c) = self.peek() else {
            return Err(python_error("unterminated character set"));
        };
        self.pos += 1;
        Ok(match c {
            'd' => ClassItem::Category(r"\d"),
            'D' => ClassItem::Category(r"\D"),
            'w' => ClassItem::Category(r"\w"),
            'W' => ClassItem::Category(r"\W"),
            's' => ClassItem::Category(r"\s"),
            'S' => ClassItem::Category(r"\S"),
            'b' => return Err(unsupported("`\\b` in a class (a backspace in Python)")),
            _ => ClassItem::Literal(self.literal_escape(c)?),
        })
    }
}

// --- plain keys ----------------------------------------------------------------------------------

const NONE: u32 = u32::MAX;

/// Plain keys (literals and `.`), reversed into one trie: node 0 is the end
/// of a module path; a lookup walks the path backwards once, following
/// literal and `.` edges, and takes the smallest entry index of a key that
/// ends where `(.*\.)?` may begin (the path's start, or after a `.` with no
/// newline before it).
#[derive(Debug, Clone)]
struct PlainTrie {
    /// Child through a `.` atom, per node.
    any: Vec<u32>,
    /// Smallest entry index of a key ending at the node.
    term: Vec<u32>,
    /// Smallest entry index of any key through the node (for pruning).
    min_below: Vec<u32>,
    /// Children through literal atoms.
    lits: HashMap<(u32, char), u32>,
}

impl PlainTrie {
    fn new() -> PlainTrie {
        PlainTrie {
            any: vec![NONE],
            term: vec![NONE],
            min_below: vec![NONE],
            lits: HashMap::new(),
        }
    }

    fn insert(&mut self, atoms: &[Atom], index: usize) {
        // Entry indices are below MAX_PATTERN_KEYS in a parsed config; a
        // larger table built directly saturates, which only loses pruning.
        let index = u32::try_from(index).unwrap_or(NONE - 1);
        let mut node = 0u32;
        self.min_below[0] = self.min_below[0].min(index);
        for &atom in atoms.iter().rev() {
            let existing = match atom {
                Atom::Any => Some(self.any[node as usize]).filter(|&c| c != NONE),
                Atom::Lit(c) => self.lits.get(&(node, c)).copied(),
            };
            node = match existing {
                Some(child) => child,
                None => {
                    let child = u32::try_from(self.any.len()).unwrap_or(NONE);
                    self.any.push(NONE);
                    self.term.push(NONE);
                    self.min_below.push(index);
                    match atom {
                        Atom::Any => self.any[node as usize] = child,
                        Atom::Lit(c) => {
                            self.lits.insert((node, c), child);
                        }
                    }
                    child
                }
            };
            let n = node as usize;
            self.min_below[n] = self.min_below[n].min(index);
        }
        let n = node as usize;
        self.term[n] = self.term[n].min(index);
    }

    /// The smallest entry index of a plain key matching `path`.
    fn first_match(&self, path: &str) -> Option<usize> {
        if self.any.len() == 1 && self.term[0] == NONE {
            return None;
        }
        let chars: Vec<char> = path.chars().collect();
        let n = chars.len();
        let first_newline = chars.iter().position(|&c| c == '\n').unwrap_or(n);
        // A key may match the suffix from `i`: `(.*\.)?` takes `chars[..i]`.
        let boundary = |i: usize| i == 0 || (chars[i - 1] == '.' && first_newline >= i - 1);
        let mut best = NONE;
        if boundary(n) {
            best = self.term[0];
        }
        let mut active = vec![0u32];
        let mut next = Vec::new();
        for i in (0..n).rev() {
            let c = chars[i];
            next.clear();
            for &node in &active {
                let any = self.any[node as usize];
                if c != '\n' && any != NONE && self.min_below[any as usize] < best {
                    next.push(any);
                }
                if let Some(&child) = self.lits.get(&(node, c))
                    && self.min_below[child as usize] < best
                {
                    next.push(child);
                }
            }
            std::mem::swap(&mut active, &mut next);
            if active.is_empty() {
                break;
            }
            if boundary(i) {
                for &node in &active {
                    best = best.min(self.term[node as usize]);
                }
            }
        }
        (best != NONE).then_some(best as usize)
    }
}

#[cfg(test)]
mod tests;
