//! The deployable definitions agree with each other and with the code: every `${Placeholder}` in the
//! state machine is substituted by the SAM template, every Lambda the template builds exists as a
//! crate, and every error name the state machine's Retry/Catch match is one the code can produce.

use std::collections::BTreeSet;
use std::path::Path;

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn placeholders(asl: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = asl;
    while let Some(i) = rest.find("${") {
        let end = rest[i..].find('}').expect("closed placeholder");
        out.insert(rest[i + 2..i + end].to_string());
        rest = &rest[i + end..];
    }
    out
}

/// Keys of the `DefinitionSubstitutions:` mapping in the template (indentation-based).
fn substitutions(template: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut lines = template.lines().skip_while(|l| !l.trim_start().starts_with("DefinitionSubstitutions:"));
    let head = lines.next().expect("DefinitionSubstitutions in the template");
    let base = head.len() - head.trim_start().len();
    for l in lines {
        let indent = l.len() - l.trim_start().len();
        if l.trim().is_empty() || indent <= base {
            break;
        }
        if let Some((k, _)) = l.trim().split_once(':') {
            out.insert(k.to_string());
        }
    }
    out
}

#[test]
fn every_placeholder_is_substituted_and_none_is_unused() {
    let asl = read("statemachine/hydrate.asl.json");
    let template = read("infra/template.yaml");
    let used = placeholders(&asl);
    let given = substitutions(&template);
    assert!(!used.is_empty());
    assert_eq!(used, given, "ASL placeholders vs template DefinitionSubstitutions");
    serde_json::from_str::<serde_json::Value>(&asl).expect("the ASL is JSON");
}

#[test]
fn every_function_the_template_builds_is_a_crate_of_the_workspace() {
    let template = read("infra/template.yaml");
    let workspace = read("Cargo.toml");
    let binaries: Vec<&str> = template.lines().filter_map(|l| l.trim().strip_prefix("Binary: ")).collect();
    assert_eq!(binaries.len(), 7, "{binaries:?}");
    for b in binaries {
        assert!(workspace.contains(&format!("\"functions/{b}\"")), "functions/{b} is not a workspace member");
        assert!(root().join("functions").join(b).join("src/main.rs").exists(), "functions/{b}/src/main.rs");
    }
}

fn error_names(v: &serde_json::Value, out: &mut BTreeSet<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                if k == "ErrorEquals" {
                    for e in x.as_array().unwrap() {
                        out.insert(e.as_str().unwrap().to_string());
                    }
                } else {
                    error_names(x, out);
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| error_names(x, out)),
        _ => {}
    }
}

#[test]
fn retry_and_catch_match_errors_the_code_produces() {
    let asl: serde_json::Value = serde_json::from_str(&read("statemachine/hydrate.asl.json")).unwrap();
    let mut names = BTreeSet::new();
    error_names(&asl, &mut names);
    // The engine's error names (Error::name); the only source of Lambda error types.
    let engine = read("engine/src/error.rs");
    for n in names {
        // Step Functions' and Lambda's own: a Lambda API error, and a function killed at its timeout.
        if n.starts_with("States.") || n.starts_with("Lambda.") || n == "Sandbox.Timedout" {
            continue;
        }
        assert!(engine.contains(&format!("=> \"{n}\"")), "the ASL matches {n:?}, which no engine error is named");
    }
}
