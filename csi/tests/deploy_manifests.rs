//! The deploy manifests against the binaries they run: every kustomize target is rendered and
//! every object validated offline (scripts/check-manifests.py: `kubectl kustomize`, the
//! Kubernetes schemas of the supported versions, pillar's CRD schemas), and every pillar
//! container's argv is parsed with the binary's own command-line parser, so a renamed or
//! removed flag fails here rather than in a cluster.
//!
//! Needs kubectl and the Python venv of scripts/setup.sh (`PILLAR_PYTHON`); without them the
//! test says so and passes, unless `PILLAR_REQUIRE_MANIFEST_TOOLS=1` (scripts/test.sh sets it).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::{CommandFactory, Parser};

#[derive(Debug, serde::Deserialize)]
struct Container {
    origin: String,
    workload: String,
    container: String,
    binary: String,
    argv: Vec<String>,
    env: BTreeMap<String, String>,
}

fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// The pillar containers of every rendered target, or `None` when the tools are missing.
fn rendered_containers() -> Option<Vec<Container>> {
    let python = std::env::var("PILLAR_PYTHON").unwrap_or_else(|_| "python3".into());
    let required = std::env::var("PILLAR_REQUIRE_MANIFEST_TOOLS").is_ok_and(|v| v == "1");
    let have_kubectl = Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success());
    let have_python = Command::new(&python)
        .args(["-c", "import kubernetes_validate, jsonschema, yaml"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !(have_kubectl && have_python) {
        assert!(
            !required,
            "kubectl ({have_kubectl}) or {python} with kubernetes-validate ({have_python}) \
             missing: run scripts/setup.sh"
        );
        println!("kubectl or kubernetes-validate missing: manifests not checked");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("containers.json");
    let out = Command::new(&python)
        .arg(project_root().join("scripts/check-manifests.py"))
        .arg("--containers-json")
        .arg(&json)
        .output()
        .unwrap();
    print!("{}", String::from_utf8_lossy(&out.stdout));
    assert!(
        out.status.success(),
        "manifest check failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap())
}

/// `argv` plus, for each flag the parser can also take from an environment variable the
/// container sets (`NODE_NAME`), that flag with the container's value: the test process's own
/// environment stays out of it.
fn with_env_flags(
    cmd: &clap::Command,
    argv: &[String],
    env: &BTreeMap<String, String>,
) -> Vec<String> {
    let mut cmd = cmd;
    if let Some(sub) = argv.first().and_then(|a| cmd.find_subcommand(a)) {
        cmd = sub;
    }
    let mut full = argv.to_vec();
    for arg in cmd.get_arguments() {
        let (Some(var), Some(long)) = (arg.get_env(), arg.get_long()) else {
            continue;
        };
        if let Some(value) = env.get(var.to_string_lossy().as_ref()) {
            full.push(format!("--{long}={value}"));
        }
    }
    full
}

fn parse(c: &Container, argv: &[String]) -> Result<(), String> {
    let run = |cmd: clap::Command, parse: &dyn Fn(Vec<String>) -> Result<(), clap::Error>| {
        let full = with_env_flags(&cmd, argv, &c.env);
        parse(std::iter::once(c.binary.clone()).chain(full).collect()).map_err(|e| e.to_string())
    };
    match c.binary.as_str() {
        "pillar-csi" => run(pillar_csi::cli::Args::command(), &|v| {
            pillar_csi::cli::Args::try_parse_from(v).map(drop)
        }),
        "pillar-agent" => run(pillar_agent::cli::Args::command(), &|v| {
            pillar_agent::cli::Args::try_parse_from(v).map(drop)
        }),
        other => Err(format!("no parser for binary {other:?}")),
    }
}

#[test]
fn every_pillar_container_runs_a_command_line_its_binary_accepts() {
    let Some(containers) = rendered_containers() else {
        return;
    };
    let mut seen = Vec::new();
    for c in &containers {
        if let Err(e) = parse(c, &c.argv) {
            panic!(
                "{} {} container {:?}: `{} {}` is refused by the binary's parser:\n{e}",
                c.origin,
                c.workload,
                c.container,
                c.binary,
                c.argv.join(" ")
            );
        }
        seen.push(format!(
            "{} {}",
            c.binary,
            c.argv.first().cloned().unwrap_or_default()
        ));
    }
    // The three roles are deployed (a manifest that lost one would pass the loop above).
    for role in ["pillar-csi controller", "pillar-csi node"] {
        assert!(
            seen.iter().any(|s| s == role),
            "no {role} container in {seen:?}"
        );
    }
    assert!(
        seen.iter().any(|s| s.starts_with("pillar-agent ")),
        "no pillar-agent container in {seen:?}"
    );
    println!("parsed: {seen:?}");

    // The check can fail: a flag renamed in a manifest is refused.
    let controller = containers
        .iter()
        .find(|c| c.binary == "pillar-csi" && c.argv.first().is_some_and(|a| a == "controller"))
        .unwrap();
    let mut renamed = controller.argv.clone();
    renamed.push("--agent-client-certificate=/tls/tls.crt".into());
    assert!(
        parse(controller, &renamed).is_err(),
        "a renamed flag was accepted"
    );
}
