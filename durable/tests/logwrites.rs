//! The dm-log-writes reader and replay on logs built by hand, laid out as the kernel writes
//! them: every point replays to the bytes the writes before it left, and a damaged log is
//! refused, never read short.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pillar_durable::logwrites::{Log, LogBuilder, LogError, MAGIC, Replay, flag};

const BLOCK: usize = 512;

fn filled(byte: u8, blocks: usize) -> Vec<u8> {
    vec![byte; blocks * BLOCK]
}

/// Two writes, a flush, a FUA write, a mark, a discard, a write left unflushed.
fn sample() -> LogBuilder {
    LogBuilder::new(512)
        .write(2, &filled(0xa1, 2), 0)
        .write(8, &filled(0xb2, 1), 0)
        .flush()
        .write(2, &filled(0xc3, 1), flag::FUA)
        .mark("acked-1")
        .discard(8, 1)
        .write(15, &filled(0xd4, 1), 0)
}

#[test]
fn a_log_reads_back_as_it_was_built() {
    let built = sample();
    let log = Log::parse(&built.build()).unwrap();
    assert_eq!(log.sectorsize, 512);
    assert_eq!(log.entries.len(), 7);
    assert_eq!(log.counts(), (7, 4, 2, 1));
    assert_eq!(log.entries[0].sector, 2);
    assert_eq!(log.entries[0].nr_sectors, 2);
    assert_eq!(log.entries[0].data, filled(0xa1, 2));
    assert_eq!(log.entries[2].flags, flag::FLUSH);
    assert_eq!(log.entries[4].mark.as_deref(), Some("acked-1"));
    assert!(log.entries[5].data.is_empty(), "a discard carries no data");
    assert_eq!(log.entries[5].nr_sectors, 1);
}

#[test]
fn each_point_replays_to_the_writes_before_it() {
    let log = Log::parse(&sample().build()).unwrap();
    let base = vec![0x11u8; 16 * BLOCK];
    let mut replay = Replay::new(log, base.clone());
    assert_eq!(replay.points(), vec![2, 3, 4]);
    let block = |image: &[u8], n: usize| image[n * BLOCK..(n + 1) * BLOCK].to_vec();

    replay.advance_to(2).unwrap();
    let image = replay.image().to_vec();
    assert_eq!(block(&image, 2), filled(0xa1, 1));
    assert_eq!(block(&image, 3), filled(0xa1, 1));
    assert_eq!(block(&image, 8), filled(0xb2, 1));
    assert_eq!(
        block(&image, 1),
        block(&base, 1),
        "untouched blocks keep the base"
    );

    replay.advance_to(3).unwrap();
    assert_eq!(block(replay.image(), 2), filled(0xc3, 1));
    assert_eq!(block(replay.image(), 3), filled(0xa1, 1));

    // Past the last point: the discard zeroes, the unflushed write lands.
    replay.advance_to(6).unwrap();
    assert_eq!(block(replay.image(), 8), vec![0u8; BLOCK]);
    assert_eq!(block(replay.image(), 15), filled(0xd4, 1));

    // The image file holds the same bytes (zero blocks as holes).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("image");
    replay.write_image(&path).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), replay.image());
}

#[test]
fn a_damaged_log_is_refused() {
    let good = sample().build();

    let mut bad_magic = good.clone();
    bad_magic[0] ^= 1;
    assert!(matches!(Log::parse(&bad_magic), Err(LogError::Magic(m)) if m != MAGIC));

    let mut bad_version = good.clone();
    bad_version[8] = 2;
    assert!(matches!(
        Log::parse(&bad_version),
        Err(LogError::Version(2))
    ));

    let mut bad_size = good.clone();
    bad_size[24..28].copy_from_slice(&300u32.to_le_bytes());
    assert!(matches!(
        Log::parse(&bad_size),
        Err(LogError::SectorSize(300))
    ));

    // One byte short: the last entry's data is cut, and the log is refused whole.
    let short = &good[..good.len() - 1];
    assert!(matches!(
        Log::parse(short),
        Err(LogError::Truncated { index: 6, .. })
    ));

    // A super block claiming more entries than the log holds.
    let mut more = good.clone();
    more[16..24].copy_from_slice(&8u64.to_le_bytes());
    assert!(matches!(
        Log::parse(&more),
        Err(LogError::Truncated { index: 7, .. })
    ));

    // An unknown flag on the first entry.
    let mut flags = good.clone();
    flags[BLOCK + 16] |= 1 << 6;
    assert!(matches!(
        Log::parse(&flags),
        Err(LogError::Flags { index: 0, .. })
    ));

    assert!(matches!(
        Log::parse(&good[..20]),
        Err(LogError::NoSuper { len: 20 })
    ));
}

#[test]
fn a_write_past_the_device_is_refused_by_the_replay() {
    let log = Log::parse(&sample().build()).unwrap();
    let mut replay = Replay::new(log, vec![0u8; 10 * BLOCK]);
    assert!(replay.advance_to(5).is_ok());
    assert!(matches!(
        replay.advance_to(6),
        Err(LogError::OutOfRange { index: 6, .. })
    ));
}
