//! Both engines' configfs paths against the configfs test double: the double sits below the
//! engine (its rules kept with the root, `ConfigfsRoot::ruled`), so a plan on it makes the very
//! syscalls (io_uring chains, or the synchronous executor's) a plan on the kernel makes, and the
//! double refuses and completes around them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pillar_agent::engine::sync::SyncEngine;
use pillar_agent::engine::uring::{UringConfig, UringEngine};
use pillar_agent::engine::{ConfigfsRoot, DurableDir, Engine, EngineError};
use pillar_nvmet::{ConfigfsDouble, Executor, Op, apply};

fn engines() -> Vec<Engine> {
    vec![
        Engine::Uring(UringEngine::start(UringConfig::default()).expect("io_uring works here")),
        Engine::Sync(SyncEngine::new()),
    ]
}

/// A fresh double under `dir`, recording its operations, and its root as the engine takes it.
fn double_root(dir: &Path) -> (ConfigfsDouble, ConfigfsRoot) {
    let double = ConfigfsDouble::create(dir).unwrap();
    double.record_ops().unwrap();
    let root = DurableDir::open(dir).unwrap();
    (double.clone(), ConfigfsRoot::ruled(root, Arc::new(double)))
}

const NQN: &str = "nqn.2024-01.io.pillar:vol-a";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001";

fn mkdir(path: &str) -> Op {
    Op::Mkdir { path: path.into() }
}

fn write(path: &str, value: &str) -> Op {
    Op::Write {
        path: path.into(),
        value: value.into(),
    }
}

fn sub(rest: &str) -> String {
    format!("subsystems/{NQN}/{rest}")
}

/// An export and most of its unexport, every kind of operation in it: items, attribute writes
/// (one shorter than the value it replaces, one the kernel normalises), both kinds of link,
/// an unlink and rmdirs of items holding attributes and default groups.
fn plan(device: &Path) -> Vec<Op> {
    let port_link = format!("ports/1/subsystems/{NQN}");
    vec![
        mkdir(&format!("subsystems/{NQN}")),
        write(&sub("attr_serial"), "0123456789abcdef"),
        write(&sub("attr_model"), "X"),
        mkdir(&sub("namespaces/1")),
        write(
            &sub("namespaces/1/device_path"),
            &device.display().to_string(),
        ),
        write(
            &sub("namespaces/1/device_uuid"),
            "6A1F3C2E-1B7D-4D2A-9C3E-0F1E2D3C4B5A",
        ),
        write(
            &sub("namespaces/1/device_nguid"),
            "00112233-4455-6677-8899-aabbccddeeff",
        ),
        write(&sub("namespaces/1/enable"), "1"),
        mkdir(&format!("hosts/{HOST}")),
        Op::Symlink {
            target: format!("hosts/{HOST}").into(),
            link: sub(&format!("allowed_hosts/{HOST}")).into(),
        },
        mkdir("ports/1"),
        write("ports/1/addr_trtype", "tcp"),
        write("ports/1/addr_adrfam", "ipv4"),
        write("ports/1/addr_traddr", "127.0.0.1"),
        write("ports/1/addr_trsvcid", "4420"),
        Op::Symlink {
            target: format!("subsystems/{NQN}").into(),
            link: port_link.clone().into(),
        },
        Op::Unlink {
            path: port_link.into(),
        },
        Op::Rmdir {
            path: "ports/1".into(),
        },
        Op::Unlink {
            path: sub(&format!("allowed_hosts/{HOST}")).into(),
        },
        Op::Rmdir {
            path: format!("hosts/{HOST}").into(),
        },
        Op::Rmdir {
            path: sub("namespaces/1").into(),
        },
    ]
}

/// Every entry under `root` with what it holds: a file's bytes, a link's target as read.
fn tree(root: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let rel = path.strip_prefix(root).unwrap().to_path_buf();
            let meta = path.symlink_metadata().unwrap();
            let shown = if meta.file_type().is_symlink() {
                format!("-> {}", std::fs::read_link(&path).unwrap().display())
            } else if meta.is_dir() {
                dirs.push(path.clone());
                "dir".into()
            } else {
                std::fs::read_to_string(&path).unwrap()
            };
            out.push((rel, shown));
        }
    }
    out.sort();
    out
}

// The engine's configfs path leaves the double's tree exactly as the double's own executor
// does: default attributes and groups after a mkdir, values as the kernel keeps them (no tail
// of a longer old value), links relative, items with their attributes removed, and the same
// operation record.
#[tokio::test]
async fn a_plan_through_the_engine_leaves_the_double_as_its_own_executor_does() {
    let device = tempfile::NamedTempFile::new().unwrap();
    let ops = plan(device.path());
    let reference = tempfile::tempdir().unwrap();
    let (mut double, _) = double_root(reference.path());
    apply(&mut double as &mut dyn Executor, &ops).unwrap();
    let expected = tree(reference.path());
    assert!(
        expected.contains(&(sub("attr_model").into(), "X\n".into())),
        "{expected:?}"
    );
    for engine in engines() {
        let tmp = tempfile::tempdir().unwrap();
        let (double, root) = double_root(tmp.path());
        engine.apply_configfs(&root, ops.clone()).await.unwrap();
        assert_eq!(tree(tmp.path()), expected, "{}", engine.name());
        assert_eq!(double.recorded_ops().unwrap(), ops, "{}", engine.name());
    }
}

// A plan the double refuses midway fails through the engine as on the kernel: the engine's
// error names the refused operation with the kernel's errno, the operations before it are
// applied (and recorded) and nothing after it runs. The same plan through the kernel's path on
// the plain tree fails at once: without the double's rules below the engine the tree has no
// `namespaces` group to make a namespace in.
#[tokio::test]
async fn the_doubles_refusal_ends_an_engine_plan_at_that_operation() {
    let device = tempfile::NamedTempFile::new().unwrap();
    let ops = vec![
        mkdir(&format!("subsystems/{NQN}")),
        mkdir(&sub("namespaces/1")),
        write(
            &sub("namespaces/1/device_path"),
            &device.path().display().to_string(),
        ),
        write(&sub("namespaces/1/enable"), "1"),
        // The kernel's K2: no device swap under an enabled namespace.
        write(&sub("namespaces/1/device_path"), "/dev/other"),
        mkdir("ports/1"),
    ];
    for engine in engines() {
        let tmp = tempfile::tempdir().unwrap();
        let (double, root) = double_root(tmp.path());
        let err = engine.apply_configfs(&root, ops.clone()).await.unwrap_err();
        let EngineError::Configfs(refused) = err else {
            panic!("{}: {err}", engine.name())
        };
        assert_eq!(refused.index, 4, "{}", engine.name());
        assert_eq!(refused.op, ops[4]);
        assert_eq!(refused.source.raw_os_error(), Some(libc::EBUSY));
        assert_eq!(double.recorded_ops().unwrap(), ops[..4]);
        let shown = std::fs::read_to_string(tmp.path().join(sub("namespaces/1/device_path")));
        assert_eq!(shown.unwrap(), format!("{}\n", device.path().display()));
        assert!(!tmp.path().join("ports/1").exists(), "{}", engine.name());

        let plain = tempfile::tempdir().unwrap();
        ConfigfsDouble::create(plain.path()).unwrap();
        let kernel = ConfigfsRoot::kernel(DurableDir::open(plain.path()).unwrap());
        let err = engine
            .apply_configfs(&kernel, ops.clone())
            .await
            .unwrap_err();
        let EngineError::Configfs(failed) = err else {
            panic!("{}: {err}", engine.name())
        };
        assert_eq!(failed.index, 1, "{}", engine.name());
        assert_eq!(failed.source.raw_os_error(), Some(libc::ENOENT));
    }
}

// A refusal changes nothing and leaves the engine healthy: the next plan on the same root runs,
// and an operation the double refuses first in a plan (a mkdir where configfs has no group)
// fails with EPERM without touching the tree.
#[tokio::test]
async fn a_refused_first_operation_changes_nothing() {
    for engine in engines() {
        let tmp = tempfile::tempdir().unwrap();
        let (_, root) = double_root(tmp.path());
        let before = tree(tmp.path());
        let err = engine
            .apply_configfs(&root, vec![mkdir("elsewhere"), mkdir("ports/1")])
            .await
            .unwrap_err();
        let EngineError::Configfs(refused) = err else {
            panic!("{}: {err}", engine.name())
        };
        assert_eq!(refused.index, 0);
        assert_eq!(refused.source.raw_os_error(), Some(libc::EPERM));
        assert_eq!(tree(tmp.path()), before, "{}", engine.name());
        engine
            .apply_configfs(&root, vec![mkdir("ports/1")])
            .await
            .unwrap();
        assert!(tmp.path().join("ports/1/addr_trtype").is_file());
    }
}
