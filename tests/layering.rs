//! Layering: no import circle among the files of `src/`.
//!
//! A file that uses a name from another file sits above it. When files reach each other, directly
//! or through others, none of them can be read, changed or tested without the rest (issue 29 found
//! the data plane grown into one 13-file knot). This test reads `src/` as text, draws an arrow from
//! each file to every file whose names it uses, and fails on every strongly connected group of
//! files, listing for each arrow inside it the names that tie the two files: those are what to
//! move down into a file both may use.
//!
//! One kind of group is allowed: a folder's `mod.rs` with its own direct children (the front door
//! re-exports what the children define, and the children use what it declares). A grandchild, or
//! a second folder's `mod.rs`, in the group makes it a circle.
//!
//! What makes an arrow, read from the text with its comments removed (string literals stay:
//! `#[serde(with = "crate::…")]` names a path the compiler follows):
//! - `use crate::…`, `use super::…` and `use self::…`, with `{}` groups and `as` renames expanded;
//! - a path `crate::a::Name`, `super::a::Name` or `self::a::Name` anywhere in the code;
//! - `x::Name`, where `x` is a module the file imported by name (`use crate::relay::pending;`,
//!   `use super::park::{self, …}`) or declared as its child (`mod x;`). Importing a module ties
//!   nothing by itself: the arrow is drawn where a name in it is used.
//!
//! A path resolves to the longest prefix that is a file (`a/b.rs` or `a/b/mod.rs` is `a::b`), and
//! the arrow carries the name that follows it. `super` is taken from the file, also inside an
//! inline `mod tests { … }` (an extra arrow at worst, never a missed one). A glob (`::*`) ties
//! nothing, and the crate root (`lib.rs`, `main.rs`) is never a target: everything may use it.
//! Text cannot see through macros or globs, so open the files a failure names before acting.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Read;
use std::path::Path;

/// The largest file of `src/` is about 64 KB; a file larger than this is refused, not read.
const MAX_SOURCE_BYTES: u64 = 4 << 20;

#[test]
fn the_files_of_src_form_no_import_circle() {
    let layering = Layering::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let groups = layering.groups();
    let circles = groups.iter().filter(|group| group.circle).count();
    assert!(
        circles == 0,
        "import circles among the files of src/: the files of each group reach each other, \
         directly or through the others; move what the arrows name down into a file both sides \
         may use (tests/layering.rs says what makes an arrow)\n{}",
        layering.report(&groups)
    );
}

/// One `.rs` file of the tree and the module it is.
struct SourceFile {
    /// As shown in a report: `src/relay/pending.rs`.
    shown: String,
    /// `["relay", "pending"]`; empty for the crate root (`lib.rs`, `main.rs`).
    module: Vec<String>,
    /// A folder's `mod.rs`.
    front_door: bool,
    /// The text with its comments replaced by a space.
    code: String,
}

/// The files of a source tree and the arrows between them.
struct Layering {
    files: Vec<SourceFile>,
    /// From file, to file (indices into `files`): the names the first uses from the second.
    arrows: BTreeMap<(usize, usize), BTreeSet<String>>,
}

/// A strongly connected group of two or more files.
struct Group {
    /// Indices into `files`, in the order of their shown paths.
    members: Vec<usize>,
    /// Anything other than one `mod.rs` with its own direct children.
    circle: bool,
}

/// A path of a `use` statement once its groups are expanded: `a::{b as c}` is `a::b`, renamed `c`.
struct UsePath {
    segments: Vec<String>,
    rename: Option<String>,
}

impl Layering {
    /// Reads every `.rs` file under `src` and draws the arrows between them.
    fn read(src: &Path) -> Layering {
        let mut found = Vec::new();
        collect_sources(src, &mut Vec::new(), &mut found);
        found.sort_by_key(|relative| relative.join("/"));
        let files = found
            .into_iter()
            .map(|relative: Vec<String>| {
                let shown = format!("src/{}", relative.join("/"));
                let text = read_bounded(&src.join(relative.join("/")), &shown);
                let mut module = relative;
                let file_name = module.pop().unwrap_or_default();
                let stem = file_name.trim_end_matches(".rs");
                if !matches!(stem, "mod" | "lib" | "main") {
                    module.push(stem.to_string());
                }
                SourceFile {
                    shown,
                    module,
                    front_door: file_name == "mod.rs",
                    code: without_comments(&text),
                }
            })
            .collect();
        let mut layering = Layering {
            files,
            arrows: BTreeMap::new(),
        };
        layering.draw_arrows();
        layering
    }

    fn draw_arrows(&mut self) {
        let mut by_module = BTreeMap::new();
        for (index, file) in self.files.iter().enumerate() {
            // The root is never a target; of two files for one module (`a.rs` and `a/mod.rs`,
            // which the compiler refuses) the first in order stands for it.
            if !file.module.is_empty() {
                by_module.entry(file.module.clone()).or_insert(index);
            }
        }
        for from in 0..self.files.len() {
            let file = &self.files[from];
            let starts = path_starts(file.code.as_bytes());
            let mut paths = use_paths(&file.code, &starts);
            paths.extend(
                inline_paths(&file.code, &starts)
                    .into_iter()
                    .map(|segments| UsePath {
                        segments,
                        rename: None,
                    }),
            );
            // Modules this file names as a whole, by the name it uses for them.
            let mut modules_by_name: BTreeMap<String, BTreeSet<usize>> = BTreeMap::new();
            let mut ties: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
            for path in paths {
                let Some(mut full) = absolute(&file.module, &path.segments) else {
                    continue;
                };
                // `use a::b::{self}` imports the module `a::b` itself.
                let names_itself =
                    path.segments.len() > 1 && full.last().is_some_and(|s| s == "self");
                if names_itself {
                    full.pop();
                }
                let Some((to, depth)) = longest_file_prefix(&by_module, &full) else {
                    continue;
                };
                if self.files[to].module == file.module {
                    continue;
                }
                if depth == full.len() {
                    // Known by its own name and by its rename: more arrows than the compiler
                    // would draw is the safe side.
                    let names = full.last().into_iter().chain(path.rename.as_ref());
                    for name in names {
                        modules_by_name.entry(name.clone()).or_default().insert(to);
                    }
                } else if full[depth] != "*" {
                    ties.entry(to).or_default().insert(full[depth].clone());
                }
            }
            for child in declared_children(&file.code, &starts) {
                let mut module = file.module.clone();
                module.push(child.clone());
                if let Some(&to) = by_module.get(&module) {
                    modules_by_name.entry(child).or_default().insert(to);
                }
            }
            for (qualifier, name) in qualified_names(&file.code, &starts) {
                for &to in modules_by_name.get(qualifier).into_iter().flatten() {
                    if self.files[to].module != file.module {
                        ties.entry(to).or_default().insert(name.to_string());
                    }
                }
            }
            for (to, names) in ties {
                self.arrows.insert((from, to), names);
            }
        }
    }

    /// Every strongly connected group of two or more files, the largest first.
    fn groups(&self) -> Vec<Group> {
        let mut next = vec![Vec::new(); self.files.len()];
        for &(from, to) in self.arrows.keys() {
            next[from].push(to);
        }
        let mut groups: Vec<Group> = strongly_connected(&next)
            .into_iter()
            .filter(|members| members.len() > 1)
            .map(|mut members| {
                members.sort_unstable();
                let circle = !self.is_folder_with_its_children(&members);
                Group { members, circle }
            })
            .collect();
        groups.sort_by(|a, b| (b.members.len(), &a.members).cmp(&(a.members.len(), &b.members)));
        groups
    }

    fn is_folder_with_its_children(&self, members: &[usize]) -> bool {
        let doors: Vec<usize> = members
            .iter()
            .copied()
            .filter(|&member| self.files[member].front_door)
            .collect();
        let [door] = doors[..] else {
            return false;
        };
        let folder = &self.files[door].module;
        members.iter().all(|&member| {
            let module = &self.files[member].module;
            member == door
                || module
                    .split_last()
                    .is_some_and(|(_, parent)| parent == &folder[..])
        })
    }

    /// Each group with its files and, for every arrow inside a circle, the names that tie the
    /// two files (a parent-child group's arrows are allowed, and left out).
    fn report(&self, groups: &[Group]) -> String {
        let mut text = String::new();
        for group in groups {
            let kind = if group.circle {
                "circle"
            } else {
                "parent-child"
            };
            let shown: Vec<&str> = group
                .members
                .iter()
                .map(|&member| self.files[member].shown.as_str())
                .collect();
            text += &format!("{kind}: {} files: {}\n", shown.len(), shown.join(", "));
            if !group.circle {
                continue;
            }
            for (&(from, to), names) in &self.arrows {
                if group.members.contains(&from) && group.members.contains(&to) {
                    let names: Vec<&str> = names.iter().map(String::as_str).collect();
                    text += &format!(
                        "  {} -> {}: {}\n",
                        self.files[from].shown,
                        self.files[to].shown,
                        names.join(", ")
                    );
                }
            }
        }
        let circles = groups.iter().filter(|group| group.circle).count();
        text += &format!(
            "{circles} circles, {} parent-child groups, {} files\n",
            groups.len() - circles,
            self.files.len()
        );
        text
    }

    /// The names `from` uses from `to`, by shown paths (for the checker's own tests).
    fn names(&self, from: &str, to: &str) -> Vec<&str> {
        let index = |shown: &str| {
            self.files
                .iter()
                .position(|file| file.shown == shown)
                .unwrap_or_else(|| panic!("no file {shown}"))
        };
        self.arrows
            .get(&(index(from), index(to)))
            .into_iter()
            .flatten()
            .map(String::as_str)
            .collect()
    }

    /// The circles, each as its files' shown paths (for the checker's own tests).
    fn circles(&self) -> Vec<Vec<&str>> {
        self.groups()
            .into_iter()
            .filter(|group| group.circle)
            .map(|group| {
                let members = group.members.iter();
                members
                    .map(|&member| self.files[member].shown.as_str())
                    .collect()
            })
            .collect()
    }
}

/// The relative paths (as components) of the `.rs` files under `dir`; symbolic links are not
/// followed.
fn collect_sources(dir: &Path, relative: &mut Vec<String>, found: &mut Vec<Vec<String>>) {
    let entries = fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
    for entry in entries {
        let entry = entry.unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
        let name = entry.file_name().to_string_lossy().into_owned();
        let kind = entry
            .file_type()
            .unwrap_or_else(|e| panic!("read {}: {e}", entry.path().display()));
        relative.push(name);
        if kind.is_dir() {
            collect_sources(&entry.path(), relative, found);
        } else if kind.is_file() && relative.last().is_some_and(|n| n.ends_with(".rs")) {
            found.push(relative.clone());
        }
        relative.pop();
    }
}

fn read_bounded(path: &Path, shown: &str) -> String {
    let file = fs::File::open(path).unwrap_or_else(|e| panic!("open {shown}: {e}"));
    let mut bytes = Vec::new();
    file.take(MAX_SOURCE_BYTES + 1)
        .read_to_end(&mut bytes)
        .unwrap_or_else(|e| panic!("read {shown}: {e}"));
    assert!(
        bytes.len() as u64 <= MAX_SOURCE_BYTES,
        "{shown} is larger than {MAX_SOURCE_BYTES} bytes: split it, or raise MAX_SOURCE_BYTES"
    );
    String::from_utf8_lossy(&bytes).into_owned()
}

fn is_word(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'_'
}

/// The text with each comment (`//` to the end of the line, `/* … */` nested) replaced by a
/// space. String and character literals are kept as they are, and a `//` or `/*` inside one
/// starts no comment (`"http://…"`); a `'` that opens no character literal is a lifetime's.
fn without_comments(text: &str) -> String {
    let bytes = text.as_bytes();
    let at = |i: usize| bytes.get(i).copied();
    let mut code = Vec::with_capacity(bytes.len());
    let mut kept_from = 0;
    let mut i = 0;
    while i < bytes.len() {
        i = match bytes[i] {
            b'/' if at(i + 1) == Some(b'/') || at(i + 1) == Some(b'*') => {
                code.extend_from_slice(&bytes[kept_from..i]);
                code.push(b' ');
                i = if at(i + 1) == Some(b'/') {
                    end_of_line(bytes, i)
                } else {
                    end_of_block_comment(bytes, i)
                };
                kept_from = i;
                continue;
            }
            b'"' => end_of_quoted(bytes, i + 1),
            b'r' if may_open_raw_string(bytes, i) => {
                end_of_raw_string(bytes, i + 1).unwrap_or(i + 1)
            }
            b'\'' => end_of_character(bytes, i).unwrap_or(i + 1),
            _ => i + 1,
        };
    }
    code.extend_from_slice(&bytes[kept_from.min(bytes.len())..]);
    String::from_utf8_lossy(&code).into_owned()
}

/// The index of the end of the line at `start` (its `\n`, or the end of the text).
fn end_of_line(bytes: &[u8], start: usize) -> usize {
    let mut i = start;
    while i < bytes.len() && bytes[i] != b'\n' {
        i += 1;
    }
    i
}

/// The index after the `*/` that closes the comment opened at `start` (comments nest).
fn end_of_block_comment(bytes: &[u8], start: usize) -> usize {
    let mut depth = 0;
    let mut i = start;
    while i + 1 < bytes.len() {
        match (bytes[i], bytes[i + 1]) {
            (b'/', b'*') => {
                depth += 1;
                i += 2;
            }
            (b'*', b'/') => {
                depth -= 1;
                i += 2;
                if depth == 0 {
                    return i;
                }
            }
            _ => i += 1,
        }
    }
    bytes.len()
}

/// The index after the closing `"` of a string whose text starts at `start`.
fn end_of_quoted(bytes: &[u8], start: usize) -> usize {
    let mut i = start;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'"' => return i + 1,
            _ => i += 1,
        }
    }
    bytes.len()
}

/// Whether the `r` at `i` may open a raw string: it ends no longer word (but `br` and `cr` do).
fn may_open_raw_string(bytes: &[u8], i: usize) -> bool {
    match i.checked_sub(1).map(|j| bytes[j]) {
        None => true,
        Some(b'b' | b'c') => i < 2 || !is_word(bytes[i - 2]),
        Some(before) => !is_word(before),
    }
}

/// The index after a raw string whose hashes start at `start` (`r#"…"#`); `None` when no `"`
/// follows them (`r#type` is a raw identifier).
fn end_of_raw_string(bytes: &[u8], start: usize) -> Option<usize> {
    let hashes = bytes[start..].iter().take_while(|&&b| b == b'#').count();
    let open = start + hashes;
    if bytes.get(open) != Some(&b'"') {
        return None;
    }
    let mut i = open + 1;
    while i < bytes.len() {
        let closed = bytes[i] == b'"'
            && bytes.len() - (i + 1) >= hashes
            && bytes[i + 1..i + 1 + hashes].iter().all(|&b| b == b'#');
        if closed {
            return Some(i + 1 + hashes);
        }
        i += 1;
    }
    Some(bytes.len())
}

/// The index after a character literal opened by the `'` at `start` (`'x'`, `'"'`, `'é'`,
/// `'\''`, `'\u{1F600}'`); `None` for a lifetime or a label (`'a`, `'outer:`).
fn end_of_character(bytes: &[u8], start: usize) -> Option<usize> {
    let first = *bytes.get(start + 1)?;
    if first == b'\\' {
        let close = bytes.get(start + 3..)?.iter().position(|&b| b == b'\'')?;
        return Some(start + 3 + close + 1);
    }
    let width = match first {
        0xF0.. => 4,
        0xE0.. => 3,
        0xC0.. => 2,
        _ => 1,
    };
    (bytes.get(start + 1 + width) == Some(&b'\'')).then_some(start + 2 + width)
}

/// Each word of the code (an identifier, a keyword or a number) that starts a path, as its byte
/// range: the words that follow `:` (`a::b`'s `b`) are left out.
fn path_starts(code: &[u8]) -> Vec<(usize, usize)> {
    let mut starts = Vec::new();
    let mut i = 0;
    while i < code.len() {
        if !is_word(code[i]) {
            i += 1;
            continue;
        }
        let end = word_end(code, i);
        if i == 0 || code[i - 1] != b':' {
            starts.push((i, end));
        }
        i = end;
    }
    starts
}

fn word_end(code: &[u8], start: usize) -> usize {
    let mut end = start;
    while end < code.len() && is_word(code[end]) {
        end += 1;
    }
    end
}

/// The word after `::` at `at`, as its end.
fn segment_after(code: &[u8], at: usize) -> Option<usize> {
    if !code[at..].starts_with(b"::") {
        return None;
    }
    let end = word_end(code, at + 2);
    (end > at + 2).then_some(end)
}

/// The paths of every `use` statement, groups expanded: `use a::{b::X, c::{Y, Z as W}};` gives
/// `a::b::X`, `a::c::Y` and `a::c::Z` renamed `W`.
fn use_paths(code: &str, starts: &[(usize, usize)]) -> Vec<UsePath> {
    let bytes = code.as_bytes();
    let mut paths = Vec::new();
    for &(start, end) in starts {
        if &bytes[start..end] != b"use" || !bytes.get(end).is_some_and(u8::is_ascii_whitespace) {
            continue;
        }
        if let Some(length) = bytes[end..].iter().position(|&b| b == b';') {
            expand_group(&[], &squeezed(&code[end..end + length]), &mut paths);
        }
    }
    paths
}

/// The body of a `use` with its whitespace collapsed to single spaces and none left beside `::`,
/// `{`, `}` or `,`.
fn squeezed(body: &str) -> String {
    let spaced = body.split_whitespace().collect::<Vec<_>>().join(" ");
    let bytes = spaced.as_bytes();
    let delimiter = |i: Option<usize>| {
        matches!(
            i.and_then(|i| bytes.get(i)),
            Some(b':' | b'{' | b'}' | b',')
        )
    };
    let mut out = Vec::with_capacity(bytes.len());
    for (i, &b) in bytes.iter().enumerate() {
        if b != b' ' || !(delimiter(i.checked_sub(1)) || delimiter(Some(i + 1))) {
            out.push(b);
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn expand_group(prefix: &[String], text: &str, paths: &mut Vec<UsePath>) {
    let Some(open) = text.find('{') else {
        for item in text.split(',').filter(|item| !item.is_empty()) {
            let (path, rename) = match item.split_once(" as ") {
                Some((path, rename)) => (path, Some(rename.trim().to_string())),
                None => (item, None),
            };
            let mut segments = prefix.to_vec();
            segments.extend(path.trim().split("::").map(str::to_string));
            paths.push(UsePath { segments, rename });
        }
        return;
    };
    let mut base = prefix.to_vec();
    let head = text[..open].trim_end_matches(':');
    base.extend(
        head.split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_string),
    );
    // The group runs to its matching `}` (or to the end of an unbalanced text), and splits at the
    // commas outside nested groups.
    let mut depth = 0;
    let mut item_start = open + 1;
    for (i, b) in text.bytes().enumerate().skip(open + 1) {
        match b {
            b'{' => depth += 1,
            b'}' if depth == 0 => {
                expand_group(&base, &text[item_start..i], paths);
                return;
            }
            b'}' => depth -= 1,
            b',' if depth == 0 => {
                expand_group(&base, &text[item_start..i], paths);
                item_start = i + 1;
            }
            _ => {}
        }
    }
    expand_group(&base, &text[item_start..], paths);
}

/// Every path `crate::…`, `super::…` or `self::…` of at least two segments, wherever it stands.
fn inline_paths(code: &str, starts: &[(usize, usize)]) -> Vec<Vec<String>> {
    let bytes = code.as_bytes();
    let mut paths = Vec::new();
    for &(start, end) in starts {
        if !matches!(&bytes[start..end], b"crate" | b"super" | b"self") {
            continue;
        }
        let mut segments = vec![code[start..end].to_string()];
        let mut at = end;
        while let Some(segment_end) = segment_after(bytes, at) {
            segments.push(code[at + 2..segment_end].to_string());
            at = segment_end;
        }
        if segments.len() > 1 {
            paths.push(segments);
        }
    }
    paths
}

/// The child modules declared without a body: `mod x;`, `pub(crate) mod x;`.
fn declared_children(code: &str, starts: &[(usize, usize)]) -> Vec<String> {
    let bytes = code.as_bytes();
    let spaces = |from: usize| {
        from + bytes[from..]
            .iter()
            .take_while(|b| b.is_ascii_whitespace())
            .count()
    };
    let mut children = Vec::new();
    for &(start, end) in starts {
        if &bytes[start..end] != b"mod" {
            continue;
        }
        let name_start = spaces(end);
        let name_end = word_end(bytes, name_start);
        if name_start > end && name_end > name_start && bytes.get(spaces(name_end)) == Some(&b';') {
            children.push(code[name_start..name_end].to_string());
        }
    }
    children
}

/// Every `x::Name` whose `x` starts a path, as `(x, Name)`.
fn qualified_names<'a>(code: &'a str, starts: &[(usize, usize)]) -> Vec<(&'a str, &'a str)> {
    let mut pairs = Vec::new();
    for &(start, end) in starts {
        if let Some(name_end) = segment_after(code.as_bytes(), end) {
            pairs.push((&code[start..end], &code[end + 2..name_end]));
        }
    }
    pairs
}

/// The path from the crate root that `segments` names in the file of `module`, if it starts
/// with `crate`, `super` or `self`. `super` is the file's parent module.
fn absolute(module: &[String], segments: &[String]) -> Option<Vec<String>> {
    let (first, mut rest) = segments.split_first()?;
    let mut full = match first.as_str() {
        "crate" => Vec::new(),
        "self" => module.to_vec(),
        "super" => {
            let mut base = module.to_vec();
            base.pop();
            while let Some(("super", further)) = rest.split_first().map(|(s, f)| (s.as_str(), f)) {
                base.pop();
                rest = further;
            }
            base
        }
        _ => return None,
    };
    full.extend(rest.iter().cloned());
    Some(full)
}

/// The file of the longest prefix of `full` that is a module, and that prefix's length.
fn longest_file_prefix(
    by_module: &BTreeMap<Vec<String>, usize>,
    full: &[String],
) -> Option<(usize, usize)> {
    (1..=full.len())
        .rev()
        .find_map(|depth| by_module.get(&full[..depth]).map(|&file| (file, depth)))
}

/// Tarjan's strongly connected components of the graph whose arrows from `v` are `next[v]`.
fn strongly_connected(next: &[Vec<usize>]) -> Vec<Vec<usize>> {
    struct Walk<'a> {
        next: &'a [Vec<usize>],
        order: Vec<Option<usize>>,
        low: Vec<usize>,
        stack: Vec<usize>,
        on_stack: Vec<bool>,
        visited: usize,
        components: Vec<Vec<usize>>,
    }
    impl Walk<'_> {
        fn visit(&mut self, v: usize) {
            self.order[v] = Some(self.visited);
            self.low[v] = self.visited;
            self.visited += 1;
            self.stack.push(v);
            self.on_stack[v] = true;
            for &w in &self.next[v] {
                match self.order[w] {
                    None => {
                        self.visit(w);
                        self.low[v] = self.low[v].min(self.low[w]);
                    }
                    Some(order) if self.on_stack[w] => self.low[v] = self.low[v].min(order),
                    Some(_) => {}
                }
            }
            if Some(self.low[v]) == self.order[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack[w] = false;
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                self.components.push(component);
            }
        }
    }
    let count = next.len();
    let mut walk = Walk {
        next,
        order: vec![None; count],
        low: vec![0; count],
        stack: Vec::new(),
        on_stack: vec![false; count],
        visited: 0,
        components: Vec::new(),
    };
    for v in 0..count {
        if walk.order[v].is_none() {
            walk.visit(v);
        }
    }
    walk.components
}

// The checker's own tests: small source trees written to a temporary directory.

/// Writes `files` (paths under `src/` and their text) to a fresh directory and reads it back.
fn layering_of(files: &[(&str, &str)]) -> Layering {
    let src = common::temp_dir("layering").join("src");
    for (path, text) in files {
        let path = src.join(path);
        fs::create_dir_all(path.parent().expect("a file has a parent")).expect("create a folder");
        fs::write(&path, text).expect("write a source file");
    }
    Layering::read(&src)
}

const ROOT: (&str, &str) = ("lib.rs", "pub mod a;\npub mod b;\npub mod c;\n");

#[test]
fn a_circle_through_sibling_files_is_caught_with_the_names_that_tie_it() {
    let layering = layering_of(&[
        ROOT,
        (
            "a.rs",
            "use crate::b::{Beta, beta_helper};\npub struct Alpha;\n",
        ),
        (
            "b.rs",
            "pub struct Beta;\npub fn gamma() -> crate::c::Gamma { todo!() }\n",
        ),
        ("c.rs", "pub struct Gamma(super::a::Alpha);\n"),
    ]);
    assert_eq!(
        layering.report(&layering.groups()),
        "circle: 3 files: src/a.rs, src/b.rs, src/c.rs\n\
         \x20 src/a.rs -> src/b.rs: Beta, beta_helper\n\
         \x20 src/b.rs -> src/c.rs: Gamma\n\
         \x20 src/c.rs -> src/a.rs: Alpha\n\
         1 circles, 0 parent-child groups, 4 files\n"
    );

    // The same files without the arrow that closes the loop: a line, not a circle.
    let layering = layering_of(&[
        ROOT,
        (
            "a.rs",
            "use crate::b::{Beta, beta_helper};\npub struct Alpha;\n",
        ),
        (
            "b.rs",
            "pub struct Beta;\npub fn gamma() -> crate::c::Gamma { todo!() }\n",
        ),
        ("c.rs", "pub struct Gamma;\n"),
    ]);
    assert!(layering.groups().is_empty());
}

#[test]
fn a_folders_mod_rs_and_its_own_children_may_use_each_other() {
    let layering = layering_of(&[
        ("lib.rs", "pub mod net;\n"),
        (
            "net/mod.rs",
            "mod frame;\nmod wire;\npub use wire::Wire;\npub struct Limits;\n\
             pub fn parse() -> frame::Frame { todo!() }\n",
        ),
        (
            "net/wire.rs",
            "use super::Limits;\npub struct Wire(Limits, super::frame::Frame);\n",
        ),
        ("net/frame.rs", "pub struct Frame(crate::net::Limits);\n"),
    ]);
    let groups = layering.groups();
    assert_eq!(layering.circles(), Vec::<Vec<&str>>::new());
    assert_eq!(groups.len(), 1);
    assert!(layering
        .report(&groups)
        .starts_with("parent-child: 3 files: src/net/frame.rs, src/net/mod.rs, src/net/wire.rs\n"));
    // `mod wire;` makes `wire::Wire` an arrow to the child's file.
    assert_eq!(
        layering.names("src/net/mod.rs", "src/net/wire.rs"),
        ["Wire"]
    );
    assert_eq!(
        layering.names("src/net/mod.rs", "src/net/frame.rs"),
        ["Frame"]
    );
}

#[test]
fn a_grandchild_or_a_second_folder_in_a_group_makes_it_a_circle() {
    // The grandchild reaches up to the folder's mod.rs, which reaches down to it.
    let layering = layering_of(&[
        ("lib.rs", "pub mod net;\n"),
        (
            "net/mod.rs",
            "pub mod wire;\npub use self::wire::frame::Frame;\npub struct Limits;\n",
        ),
        ("net/wire/mod.rs", "pub mod frame;\n"),
        (
            "net/wire/frame.rs",
            "use super::super::Limits;\npub struct Frame(Limits);\n",
        ),
    ]);
    assert_eq!(
        layering.circles(),
        [["src/net/mod.rs", "src/net/wire/frame.rs"]]
    );
    assert_eq!(
        layering.names("src/net/mod.rs", "src/net/wire/frame.rs"),
        ["Frame"]
    );
    assert_eq!(
        layering.names("src/net/wire/frame.rs", "src/net/mod.rs"),
        ["Limits"]
    );

    // Two folders' mod.rs files that reach each other (relay/ and relay/splice/ in issue 29).
    let layering = layering_of(&[
        ("lib.rs", "pub mod net;\n"),
        (
            "net/mod.rs",
            "pub mod wire;\npub struct Metrics;\npub use wire::Wire;\n",
        ),
        ("net/wire/mod.rs", "pub struct Wire(super::Metrics);\n"),
    ]);
    assert_eq!(
        layering.circles(),
        [["src/net/mod.rs", "src/net/wire/mod.rs"]]
    );
}

#[test]
fn mentions_in_comments_make_no_arrow() {
    let b_mentions_a_only_in_comments = "\
        //! Uses crate::a::Alpha? No: a comment.\n\
        /// [`crate::a::Alpha`] and `/internal/*` in a doc comment.\n\
        pub struct Beta; // crate::a::Alpha\n\
        /* use crate::a::Alpha; /* nested */ crate::a::Alpha */\n\
        pub const URL: &str = \"http://example.invalid/*\"; // crate::a::Alpha\n\
        pub const QUOTE: char = '\"'; // crate::a::Alpha\n\
        pub fn first<'a>(text: &'a str) -> &'a str { text } // crate::a::Alpha\n\
        pub const RAW: &str = r#\"a \"quoted\" // word\"#; // crate::a::Alpha\n\
        pub fn after() {}\n";
    let layering = layering_of(&[
        ROOT,
        ("a.rs", "pub struct Alpha(crate::b::Beta);\n"),
        ("b.rs", b_mentions_a_only_in_comments),
        ("c.rs", ""),
    ]);
    assert_eq!(layering.circles(), Vec::<Vec<&str>>::new());
    assert_eq!(layering.names("src/a.rs", "src/b.rs"), ["Beta"]);

    // A `//` or `/*` inside a string starts no comment: the path after it on the line is code.
    let layering = layering_of(&[
        ROOT,
        ("a.rs", "pub struct Alpha(crate::b::Beta);\n"),
        (
            "b.rs",
            "pub struct Beta;\n\
             pub fn link(beta: Beta) -> &'static str {\n\
             \x20   let (url, _alpha) = (\"http://x/*\", crate::a::Alpha(beta));\n\
             \x20   url\n\
             }\n",
        ),
        ("c.rs", ""),
    ]);
    assert_eq!(layering.circles(), [["src/a.rs", "src/b.rs"]]);
    assert_eq!(layering.names("src/b.rs", "src/a.rs"), ["Alpha"]);
}

#[test]
fn use_groups_and_renames_expand() {
    let layering = layering_of(&[
        ("lib.rs", "pub mod a;\npub mod d;\n"),
        ("d.rs", "use crate::a::{b::X, c::{Y, Z as W}};\npub struct D;\n"),
        ("a/mod.rs", "pub mod b;\npub mod c;\n"),
        ("a/b.rs", "use crate::d::D;\npub struct X(D);\n"),
        (
            "a/c.rs",
            "use crate::d as top;\npub struct Y;\npub struct Z;\npub fn d() -> top::D { todo!() }\n",
        ),
    ]);
    assert_eq!(
        layering.circles(),
        [["src/a/b.rs", "src/a/c.rs", "src/d.rs"]]
    );
    assert_eq!(layering.names("src/d.rs", "src/a/b.rs"), ["X"]);
    assert_eq!(layering.names("src/d.rs", "src/a/c.rs"), ["Y", "Z"]);
    assert_eq!(layering.names("src/a/c.rs", "src/d.rs"), ["D"]);
}

#[test]
fn a_module_imported_whole_ties_only_where_a_name_in_it_is_used_and_a_glob_never() {
    let a_uses_b = ("a.rs", "pub struct Alpha(crate::b::Beta);\n");
    let cases: &[(&str, &[&str])] = &[
        ("use crate::a;\npub struct Beta;\n", &[]),
        // A glob says nothing, even where a name it brings is used: text cannot tell.
        ("use crate::a::*;\npub struct Beta(Alpha);\n", &[]),
        ("use crate::a;\npub struct Beta(a::Alpha);\n", &["Alpha"]),
        (
            "use super::{a::{self}};\npub struct Beta(a::Alpha);\n",
            &["Alpha"],
        ),
        (
            "use crate::a::{self as first};\npub struct Beta(first::Alpha);\n",
            &["Alpha"],
        ),
        ("pub struct Beta(crate::a::Alpha);\n", &["Alpha"]),
    ];
    for &(b, names) in cases {
        let layering = layering_of(&[ROOT, a_uses_b, ("b.rs", b), ("c.rs", "")]);
        assert_eq!(layering.names("src/b.rs", "src/a.rs"), names, "b.rs: {b}");
        let circles = layering.circles();
        assert_eq!(circles.len(), usize::from(!names.is_empty()), "b.rs: {b}");
    }
}
