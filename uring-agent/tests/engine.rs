//! Both engines: durable replace and remove, group commit, fault injection at every step of the
//! chain, and configfs plans on a plain directory tree.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use pillar_agent::engine::sync::SyncEngine;
use pillar_agent::engine::uring::{IntakeGate, MAX_OPS_PER_CHAIN, UringConfig, UringEngine};
use pillar_agent::engine::{
    ConfigfsRoot, DurableDir, DurableStep, Engine, EngineError, FaultInjection,
};
use pillar_nvmet::{Executor, KernelExecutor, Op};

fn engines(fault: FaultInjection) -> Vec<Engine> {
    vec![
        Engine::Uring(
            UringEngine::start(UringConfig::default().with_fault(fault))
                .expect("io_uring works on this machine"),
        ),
        Engine::Sync(SyncEngine::with_fault(fault)),
    ]
}

fn no_fault() -> FaultInjection {
    FaultInjection::default()
}

fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn replace_installs_new_content_and_leaves_no_temp_file() {
    for engine in engines(no_fault()) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = DurableDir::open(tmp.path().join("marks")).unwrap();
        engine
            .replace_file(&dir, "a.json", b"one".to_vec())
            .await
            .unwrap();
        engine
            .replace_file(&dir, "a.json", b"two, longer".to_vec())
            .await
            .unwrap();
        engine
            .replace_file(&dir, "a.json", b"3".to_vec())
            .await
            .unwrap();
        assert_eq!(
            std::fs::read(dir.path().join("a.json")).unwrap(),
            b"3",
            "{}",
            engine.name()
        );
        assert_eq!(listing(dir.path()), vec!["a.json"], "{}", engine.name());
        engine.remove_file(&dir, "a.json").await.unwrap();
        engine.remove_file(&dir, "a.json").await.unwrap();
        assert!(listing(dir.path()).is_empty());
    }
}

// Crash safety, step by step: a failure at any step of the chain leaves the old content (or,
// once the rename ran, the complete new content), never a torn file; the failure is reported
// with its step; and the engine keeps working (no leaked descriptor slots).
#[tokio::test]
async fn a_failure_at_each_step_leaves_old_or_new_never_torn() {
    for step in DurableStep::REPLACE {
        for engine in engines(FaultInjection {
            fail_at: Some(step),
            ..FaultInjection::default()
        }) {
            let tmp = tempfile::tempdir().unwrap();
            let dir = DurableDir::open(tmp.path()).unwrap();
            std::fs::write(dir.path().join("m.json"), b"OLD").unwrap();
            let err = engine
                .replace_file(&dir, "m.json", b"NEW-CONTENT".to_vec())
                .await
                .unwrap_err();
            match &err {
                EngineError::Step { step: failed, .. } => {
                    assert_eq!(*failed, step, "{} reported {err}", engine.name())
                }
                other => panic!("{}: unexpected {other}", engine.name()),
            }
            let now = std::fs::read(dir.path().join("m.json")).unwrap();
            if step == DurableStep::FsyncDir {
                assert_eq!(
                    now,
                    b"NEW-CONTENT",
                    "{}: rename ran before the failed fsync",
                    engine.name()
                );
            } else {
                assert_eq!(
                    now,
                    b"OLD",
                    "{}: failure at {step} must keep the old file",
                    engine.name()
                );
            }
            // Far more failures than descriptor slots: each must still be answered.
            for i in 0..100 {
                let r = tokio::time::timeout(
                    Duration::from_secs(10),
                    engine.replace_file(&dir, &format!("x{i}"), vec![1; 10]),
                )
                .await;
                assert!(r.expect("answered, not stuck waiting for a slot").is_err());
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_replaces_share_directory_fsyncs() {
    let engine = Arc::new(Engine::Uring(
        UringEngine::start(UringConfig::default()).unwrap(),
    ));
    let tmp = tempfile::tempdir().unwrap();
    let dir = DurableDir::open(tmp.path()).unwrap();
    for round in 0..5 {
        let tasks: Vec<_> = (0..64)
            .map(|i| {
                let (engine, dir) = (Arc::clone(&engine), Arc::clone(&dir));
                tokio::spawn(async move {
                    engine
                        .replace_file(
                            &dir,
                            &format!("v{i}.json"),
                            format!("{round}:{i}").into_bytes(),
                        )
                        .await
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap().unwrap();
        }
    }
    for i in 0..64 {
        assert_eq!(
            std::fs::read_to_string(dir.path().join(format!("v{i}.json"))).unwrap(),
            format!("4:{i}")
        );
    }
    let [submissions, _, durable, dir_fsyncs, _] = engine.stats().snapshot();
    assert_eq!(durable, 320);
    assert!(
        dir_fsyncs < durable,
        "group commit shared directory fsyncs: {dir_fsyncs} fsyncs for {durable} writes"
    );
    assert!(
        submissions < durable,
        "requests shared submissions: {submissions} for {durable} writes"
    );
    // A request writes the eventfd only when the ring thread is about to block: 64 requests
    // sent at once find it awake (busy with the others) far more often than asleep.
    let (_, wakes) = engine.stats().syscalls();
    assert!(
        wakes < durable,
        "the ring thread was woken for every request: {wakes} eventfd writes for {durable} writes"
    );
}

fn sample_plan() -> Vec<Op> {
    let mut ops = vec![
        Op::Mkdir {
            path: "subsystems".into(),
        },
        Op::Mkdir {
            path: "subsystems/s1".into(),
        },
        Op::Mkdir {
            path: "ports".into(),
        },
        Op::Mkdir {
            path: "ports/1".into(),
        },
        Op::Mkdir {
            path: "ports/1/subsystems".into(),
        },
        Op::Symlink {
            target: "subsystems/s1".into(),
            link: "ports/1/subsystems/s1".into(),
        },
        Op::Write {
            path: "subsystems/s1/attr".into(),
            value: "hello".into(),
        },
        Op::Unlink {
            path: "ports/1/subsystems/s1".into(),
        },
        Op::Mkdir { path: "tmp".into() },
        Op::Rmdir { path: "tmp".into() },
    ];
    for i in 0..(MAX_OPS_PER_CHAIN + 10) {
        ops.push(Op::Mkdir {
            path: format!("subsystems/s1/d{i}").into(),
        });
    }
    ops
}

fn tree(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let rel = e.path().strip_prefix(root).unwrap().display().to_string();
            let ft = e.file_type().unwrap();
            if ft.is_dir() {
                stack.push(e.path());
                out.push(format!("{rel}/"));
            } else if ft.is_symlink() {
                out.push(format!("{rel} -> link"));
            } else {
                out.push(format!(
                    "{rel} = {}",
                    std::fs::read_to_string(e.path()).unwrap()
                ));
            }
        }
    }
    out.sort();
    out
}

/// Attribute files exist before a plan writes them (as configfs creates them with the item).
fn prepare_attr(root: &Path) {
    std::fs::create_dir_all(root.join("subsystems/s1")).unwrap();
    std::fs::write(root.join("subsystems/s1/attr"), b"").unwrap();
}

#[tokio::test]
async fn configfs_plans_match_the_plain_executor() {
    let reference = tempfile::tempdir().unwrap();
    let ops = sample_plan();
    prepare_attr(reference.path());
    let mut exec = KernelExecutor::new(reference.path());
    for op in ops.iter().skip(2) {
        exec.execute(op).unwrap();
    }
    for engine in engines(no_fault()) {
        let tmp = tempfile::tempdir().unwrap();
        prepare_attr(tmp.path());
        let root = DurableDir::open(tmp.path()).unwrap();
        engine
            .apply_configfs(&ConfigfsRoot::kernel(Arc::clone(&root)), ops[2..].to_vec())
            .await
            .unwrap();
        assert_eq!(
            tree(tmp.path()),
            tree(reference.path()),
            "{}",
            engine.name()
        );
    }
}

#[tokio::test]
async fn a_configfs_plan_stops_at_the_first_failure() {
    for engine in engines(no_fault()) {
        let tmp = tempfile::tempdir().unwrap();
        let root = DurableDir::open(tmp.path()).unwrap();
        let ops = vec![
            Op::Mkdir { path: "a".into() },
            Op::Write {
                path: "a/missing-attr".into(),
                value: "1".into(),
            },
            Op::Mkdir { path: "b".into() },
        ];
        let err = engine
            .apply_configfs(&ConfigfsRoot::kernel(Arc::clone(&root)), ops)
            .await
            .unwrap_err();
        let EngineError::Configfs(apply) = err else {
            panic!("{}: {err}", engine.name())
        };
        assert_eq!(apply.index, 1, "{}", engine.name());
        assert_eq!(apply.source.raw_os_error(), Some(libc::ENOENT));
        assert!(tmp.path().join("a").is_dir());
        assert!(
            !tmp.path().join("b").exists(),
            "{}: nothing after the failure ran",
            engine.name()
        );
        // And the engine is still healthy afterwards.
        engine
            .apply_configfs(
                &ConfigfsRoot::kernel(Arc::clone(&root)),
                vec![Op::Mkdir { path: "c".into() }],
            )
            .await
            .unwrap();
    }
}

// Concurrent requests are independent chains: one request failing (its target is a directory,
// so the rename fails) cancels nothing of the others submitted with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_failing_request_does_not_cancel_its_neighbours() {
    for engine in engines(no_fault()) {
        let engine = Arc::new(engine);
        let tmp = tempfile::tempdir().unwrap();
        let dir = DurableDir::open(tmp.path()).unwrap();
        std::fs::create_dir(dir.path().join("poisoned.json")).unwrap();
        for round in 0..5 {
            let tasks: Vec<_> = (0..32)
                .map(|i| {
                    let (engine, dir) = (Arc::clone(&engine), Arc::clone(&dir));
                    let name = if i == 7 {
                        "poisoned.json".to_owned()
                    } else {
                        format!("v{i}.json")
                    };
                    tokio::spawn(async move {
                        (
                            i,
                            engine
                                .replace_file(&dir, &name, format!("{round}").into_bytes())
                                .await,
                        )
                    })
                })
                .collect();
            for t in tasks {
                let (i, r) = t.await.unwrap();
                if i == 7 {
                    assert!(
                        r.is_err(),
                        "{}: the poisoned request must fail",
                        engine.name()
                    );
                } else {
                    r.unwrap_or_else(|e| {
                        panic!(
                            "{}: request {i} failed with its neighbour: {e}",
                            engine.name()
                        )
                    });
                    assert_eq!(
                        std::fs::read_to_string(dir.path().join(format!("v{i}.json"))).unwrap(),
                        format!("{round}")
                    );
                }
            }
        }
    }
}

// A push the kernel refuses (the queue was full and the submit that makes room failed) answers
// its caller with the error instead of leaving it waiting: its descriptor slot comes back (far
// more refusals than slots), the engine keeps working, and dropping it ends its thread.
#[tokio::test]
async fn a_refused_submission_answers_its_caller() {
    let engine = Engine::Uring(
        UringEngine::start(UringConfig::default().with_failing_submits(libc::EINVAL, 102)).unwrap(),
    );
    let tmp = tempfile::tempdir().unwrap();
    let dir = DurableDir::open(tmp.path()).unwrap();
    let refused = |r: Result<Result<(), EngineError>, _>| match r.expect("answered, not hanging") {
        Err(EngineError::Submit { source }) => {
            assert_eq!(source.raw_os_error(), Some(libc::EINVAL))
        }
        other => panic!("expected the submit error, got {other:?}"),
    };
    for i in 0..100 {
        refused(
            tokio::time::timeout(
                Duration::from_secs(10),
                engine.replace_file(&dir, &format!("x{i}"), vec![1; 10]),
            )
            .await,
        );
    }
    refused(tokio::time::timeout(Duration::from_secs(10), engine.remove_file(&dir, "x0")).await);
    let plan = vec![Op::Mkdir { path: "c".into() }];
    refused(
        tokio::time::timeout(
            Duration::from_secs(10),
            engine.apply_configfs(&ConfigfsRoot::kernel(Arc::clone(&dir)), plan),
        )
        .await,
    );

    engine
        .replace_file(&dir, "a.json", b"after".to_vec())
        .await
        .unwrap();
    assert_eq!(listing(dir.path()), vec!["a.json"]);
    tokio::time::timeout(
        Duration::from_secs(10),
        tokio::task::spawn_blocking(move || drop(engine)),
    )
    .await
    .expect("the ring thread ends")
    .unwrap();
}

// A busy queue (EBUSY/EAGAIN when making room) is not an error: the request waits for the next
// round, after completions were reaped, and then runs.
#[tokio::test]
async fn a_busy_queue_is_retried() {
    for errno in [libc::EBUSY, libc::EAGAIN] {
        let engine = Engine::Uring(
            UringEngine::start(UringConfig::default().with_failing_submits(errno, 5)).unwrap(),
        );
        let tmp = tempfile::tempdir().unwrap();
        let dir = DurableDir::open(tmp.path()).unwrap();
        let run = async {
            engine.replace_file(&dir, "a.json", b"1".to_vec()).await?;
            engine.remove_file(&dir, "a.json").await?;
            let plan = vec![Op::Mkdir { path: "c".into() }];
            engine
                .apply_configfs(&ConfigfsRoot::kernel(Arc::clone(&dir)), plan)
                .await
        };
        tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .expect("not stuck")
            .unwrap();
        assert_eq!(listing(dir.path()), vec!["c"]);
    }
}

// Each replace writes its own temp file: two replaces of one file at once (on io_uring, in one
// group-commit round) both succeed, the file ends with one whole content, and no temp file is
// left.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_replaces_of_one_file_do_not_share_a_temp_file() {
    let a = vec![b'a'; 256 * 1024];
    let b = vec![b'b'; 256 * 1024 + 1];
    for engine in engines(no_fault()) {
        let engine = Arc::new(engine);
        let tmp = tempfile::tempdir().unwrap();
        let dir = DurableDir::open(tmp.path()).unwrap();
        for round in 0..20 {
            let tasks: Vec<_> = [a.clone(), b.clone()]
                .into_iter()
                .map(|contents| {
                    let (engine, dir) = (Arc::clone(&engine), Arc::clone(&dir));
                    tokio::spawn(
                        async move { engine.replace_file(&dir, "same.json", contents).await },
                    )
                })
                .collect();
            for t in tasks {
                t.await
                    .unwrap()
                    .unwrap_or_else(|e| panic!("{} round {round}: {e}", engine.name()));
            }
            let now = std::fs::read(dir.path().join("same.json")).unwrap();
            assert!(
                now == a || now == b,
                "{} round {round}: torn file of {} bytes",
                engine.name(),
                now.len()
            );
            assert_eq!(listing(dir.path()), vec!["same.json"], "{}", engine.name());
        }
    }
}

// A replace that fails before its rename removes its temp file (an injected failure at every
// step, and a real one: a directory in the way of the rename). Checked once the engine is
// dropped, as the io_uring engine tidies up after answering.
#[tokio::test]
async fn a_failed_replace_leaves_no_temp_file() {
    for step in DurableStep::REPLACE {
        for engine in engines(FaultInjection {
            fail_at: Some(step),
            ..FaultInjection::default()
        }) {
            let name = engine.name();
            let tmp = tempfile::tempdir().unwrap();
            let dir = DurableDir::open(tmp.path()).unwrap();
            std::fs::write(dir.path().join("m.json"), b"OLD").unwrap();
            for _ in 0..3 {
                engine
                    .replace_file(&dir, "m.json", b"NEW".to_vec())
                    .await
                    .unwrap_err();
            }
            drop(engine);
            assert_eq!(
                listing(dir.path()),
                vec!["m.json"],
                "{name}: failure at {step}"
            );
        }
    }
    for engine in engines(no_fault()) {
        let name = engine.name();
        let tmp = tempfile::tempdir().unwrap();
        let dir = DurableDir::open(tmp.path()).unwrap();
        std::fs::create_dir(dir.path().join("d.json")).unwrap();
        let err = engine
            .replace_file(&dir, "d.json", b"NEW".to_vec())
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                EngineError::Step {
                    step: DurableStep::Rename,
                    ..
                }
            ),
            "{name}: {err}"
        );
        drop(engine);
        assert_eq!(listing(dir.path()), vec!["d.json"], "{name}");
    }
}

// The kernel does not cancel the rest of a linked chain when an mkdirat, symlinkat or unlinkat
// fails (nor post the failure when asked to skip successful completions): a plan must still
// stop at such a failure, and report it.
#[tokio::test]
async fn a_configfs_plan_stops_at_a_failed_directory_operation() {
    let failing = [
        Op::Mkdir { path: "a".into() },
        Op::Symlink {
            target: "a".into(),
            link: "a".into(),
        },
        Op::Rmdir {
            path: "missing".into(),
        },
        Op::Unlink {
            path: "missing".into(),
        },
    ];
    for bad in failing {
        for engine in engines(no_fault()) {
            let tmp = tempfile::tempdir().unwrap();
            let root = DurableDir::open(tmp.path()).unwrap();
            std::fs::create_dir(tmp.path().join("a")).unwrap();
            let ops = vec![
                Op::Mkdir { path: "x".into() },
                bad.clone(),
                Op::Mkdir { path: "y".into() },
            ];
            let err = engine
                .apply_configfs(&ConfigfsRoot::kernel(Arc::clone(&root)), ops)
                .await
                .unwrap_err();
            let EngineError::Configfs(apply) = err else {
                panic!("{}: {err}", engine.name())
            };
            assert_eq!(apply.index, 1, "{} {bad:?}", engine.name());
            assert!(tmp.path().join("x").is_dir());
            assert!(
                !tmp.path().join("y").exists(),
                "{} {bad:?}: nothing after the failure ran",
                engine.name()
            );
        }
    }
}

// A removal whose unlink fails otherwise than "already gone" reports it.
#[tokio::test]
async fn a_failed_removal_is_reported() {
    for engine in engines(no_fault()) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = DurableDir::open(tmp.path()).unwrap();
        std::fs::create_dir(dir.path().join("d.json")).unwrap();
        let err = engine.remove_file(&dir, "d.json").await.unwrap_err();
        assert!(
            matches!(
                err,
                EngineError::Step {
                    step: DurableStep::Unlink,
                    ..
                }
            ),
            "{}: {err}",
            engine.name()
        );
    }
}

// proves the engine's bound (issue 22, bounded resources): the queue into the ring thread holds
// at most its limit of requests. With the ring thread held before it takes any request, the
// engine takes `limit` requests and refuses the next at once with QueueFull, nothing of it
// applied; once the thread runs, every request it took completes, and the places are given
// back. With the bound removed (every request admitted) the refused request stays pending
// behind the held thread and the test fails at that assertion.
#[tokio::test]
async fn a_full_engine_refuses_the_next_request_at_once_and_applies_nothing_of_it() {
    use std::task::Poll;

    const LIMIT: usize = 4;
    let gate = Arc::new(IntakeGate::default());
    let engine = Engine::Uring(
        UringEngine::start(
            UringConfig::default()
                .with_queue_limit(LIMIT)
                .with_intake_gate(Arc::clone(&gate)),
        )
        .expect("io_uring works on this machine"),
    );
    // Opens the gate however the test ends, so a failing assertion does not leave the engine's
    // drop waiting for the held ring thread (dropped before the engine).
    struct OpenOnDrop(Arc<IntakeGate>);
    impl Drop for OpenOnDrop {
        fn drop(&mut self) {
            self.0.open();
        }
    }
    let _open = OpenOnDrop(Arc::clone(&gate));
    let queued = || match &engine {
        Engine::Uring(e) => e.queued(),
        Engine::Sync(_) => unreachable!(),
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = DurableDir::open(tmp.path()).unwrap();
    let names: Vec<String> = (0..LIMIT).map(|i| format!("m{i}.json")).collect();
    let mut taken: Vec<_> = names
        .iter()
        .map(|name| Box::pin(engine.replace_file(&dir, name, vec![b'x'; 64])))
        .collect();
    for request in &mut taken {
        assert!(
            futures::poll!(request.as_mut()).is_pending(),
            "taken and waiting for the held ring thread"
        );
    }
    assert_eq!(queued(), LIMIT);
    let mut refused = Box::pin(engine.replace_file(&dir, "over.json", b"x".to_vec()));
    match futures::poll!(refused.as_mut()) {
        Poll::Ready(Err(EngineError::QueueFull { limit })) => assert_eq!(limit, LIMIT),
        other => panic!("the request past the bound must be refused at once: {other:?}"),
    }
    assert_eq!(queued(), LIMIT, "a refused request takes no place");

    gate.open();
    for request in taken {
        request.await.unwrap();
    }
    assert_eq!(queued(), 0, "every place given back with its answer");
    let mut files = listing(dir.path());
    files.retain(|f| !f.starts_with('.'));
    assert_eq!(files, ["m0.json", "m1.json", "m2.json", "m3.json"]);
    engine
        .replace_file(&dir, "over.json", b"x".to_vec())
        .await
        .unwrap();
}
