//! Concurrent read-modify-CAS loops against one volume's status.

use std::sync::Arc;

use tokio::sync::Barrier;

use crate::StateStore;
use crate::crd::{AccessMode, PublishedNode};
use crate::store::Revision;
use crate::test_support::volume_spec;

const TASKS: usize = 2;
const ROUNDS: usize = 200;

/// The publish rule under test: add `node` only if nobody is published yet. Returns whether this
/// call won and how many conflicts it retried through.
async fn publish_if_free(store: &dyn StateStore, name: &str, node: &str) -> (bool, usize) {
    let mut conflicts = 0;
    loop {
        let v = store.get_volume(name).await.unwrap().unwrap();
        let mut status = v.status_or_default();
        if !status.published_nodes.is_empty() {
            return (false, conflicts);
        }
        status.published_nodes.push(PublishedNode {
            node: node.to_owned(),
            host_nqn: format!("nqn.2014-08.org.nvmexpress:uuid:{node}"),
            access_mode: AccessMode::SingleNodeWriter,
            readonly: false,
            revoking: false,
            recorded_generation: 0,
        });
        status.publication_generation += 1;
        match store
            .replace_volume_status(name, &Revision::of(&v).unwrap(), status)
            .await
        {
            Ok(_) => return (true, conflicts),
            Err(e) if e.is_conflict() => conflicts += 1,
            Err(e) => panic!("unexpected store error: {e:?}"),
        }
    }
}

// proves W1 (and W2's single writer): racing publishers for different nodes, exactly one record
async fn exactly_one_publisher_wins(store: Arc<dyn StateStore>) {
    for round in 0..ROUNDS {
        let name = format!("race-{round}");
        store
            .create_volume(&name, volume_spec(&name))
            .await
            .unwrap();
    }
    let barrier = Arc::new(Barrier::new(TASKS));
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let store = Arc::clone(&store);
        let barrier = Arc::clone(&barrier);
        tasks.push(tokio::spawn(async move {
            let node = format!("node-{t}");
            let mut results = Vec::new();
            for round in 0..ROUNDS {
                barrier.wait().await;
                results.push(publish_if_free(&*store, &format!("race-{round}"), &node).await);
            }
            results
        }));
    }
    let mut per_task = Vec::new();
    for t in tasks {
        per_task.push(t.await.unwrap());
    }
    let mut total_conflicts = 0;
    for round in 0..ROUNDS {
        let outcomes: Vec<(bool, usize)> = per_task.iter().map(|r| r[round]).collect();
        let winners: Vec<usize> = (0..TASKS).filter(|&t| outcomes[t].0).collect();
        total_conflicts += outcomes.iter().map(|o| o.1).sum::<usize>();
        assert_eq!(winners.len(), 1, "round {round}: winners {winners:?}");
        let v = store
            .get_volume(&format!("race-{round}"))
            .await
            .unwrap()
            .unwrap();
        let status = v.status_or_default();
        assert_eq!(status.published_nodes.len(), 1, "round {round}");
        assert_eq!(
            status.published_nodes[0].node,
            format!("node-{}", winners[0])
        );
        assert_eq!(status.publication_generation, 1, "round {round}");
    }
    // The race must actually have happened for the test to mean anything.
    assert!(total_conflicts > 0, "no round ever conflicted");
}

// proves F2: concurrent increments of publicationGeneration lose none
async fn no_generation_increment_is_lost(store: Arc<dyn StateStore>) {
    const INCREMENTS: u64 = 50;
    store
        .create_volume("gen", volume_spec("gen"))
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let store = Arc::clone(&store);
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            for _ in 0..INCREMENTS {
                loop {
                    let v = store.get_volume("gen").await.unwrap().unwrap();
                    let mut status = v.status_or_default();
                    status.publication_generation += 1;
                    let token = status.publication_generation;
                    match store
                        .replace_volume_status("gen", &Revision::of(&v).unwrap(), status)
                        .await
                    {
                        Ok(_) => {
                            seen.push(token);
                            break;
                        }
                        Err(e) if e.is_conflict() => {}
                        Err(e) => panic!("unexpected store error: {e:?}"),
                    }
                }
            }
            seen
        }));
    }
    let mut tokens = Vec::new();
    for t in tasks {
        tokens.extend(t.await.unwrap());
    }
    tokens.sort_unstable();
    let total = INCREMENTS * u64::try_from(TASKS).unwrap();
    assert_eq!(
        tokens,
        (1..=total).collect::<Vec<_>>(),
        "every token handed out once"
    );
    let v = store.get_volume("gen").await.unwrap().unwrap();
    assert_eq!(v.status_or_default().publication_generation, total);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_exactly_one_publisher_wins() {
    let h = crate::test_support::embedded().await;
    exactly_one_publisher_wins(h.store.clone()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_over_double_exactly_one_publisher_wins() {
    let h = crate::test_support::kube().await;
    exactly_one_publisher_wins(h.store.clone()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_no_generation_increment_is_lost() {
    let h = crate::test_support::embedded().await;
    no_generation_increment_is_lost(h.store.clone()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_over_double_no_generation_increment_is_lost() {
    let h = crate::test_support::kube().await;
    no_generation_increment_is_lost(h.store.clone()).await;
}

// No memory_exactly_one_publisher_wins: the memory store never awaits inside a call, so two
// publishers almost never interleave between their read and their write and the test's "some
// round conflicted" cannot be met. The contract's concurrent_writers_one_wins races two writers
// of one revision on it instead.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_no_generation_increment_is_lost() {
    let h = crate::test_support::memory();
    no_generation_increment_is_lost(h.store.clone()).await;
}
