//! The kernel lane's capture reader (scenario 16's look at the wire), tested on the host. Its
//! tests live in a binary of their own: every test of the lane's binary is a scenario, run in
//! the VMs and expected to print a result line.
#![allow(clippy::unwrap_used)]

#[path = "kernel_lane/capture.rs"]
mod capture;

use capture::{Seen, classify, streams};

#[test]
fn an_icreq_in_clear_is_plain_nvme_tcp_and_records_are_tls() {
    let mut icreq = vec![0u8; 128];
    icreq[2] = 128;
    icreq[4] = 128;
    assert_eq!(classify(&icreq), Seen::PlainNvmeTcp);
    let mut tls = vec![0x16, 0x03, 0x01, 0x00, 0x02, 0xaa, 0xbb];
    tls.extend_from_slice(&[0x17, 0x03, 0x03, 0x00, 0x01, 0xcc]);
    assert_eq!(
        classify(&tls),
        Seen::Tls {
            records: 2,
            bytes: 13
        }
    );
    // A command capsule in clear (type 4, header 72) is neither.
    let mut capsule = vec![0u8; 72];
    capsule[0] = 4;
    capsule[2] = 72;
    capsule[4] = 72;
    assert_eq!(classify(&capsule), Seen::Other);
}

fn frame(src: u16, dst: u16, seq: u32, syn: bool, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8; 14];
    f[12] = 0x08;
    let total = 20 + 20 + payload.len();
    let mut ip = vec![
        0x45, 0, 0, 0, 0, 0, 0, 0, 64, 6, 0, 0, 127, 0, 0, 1, 127, 0, 0, 1,
    ];
    ip[2..4].copy_from_slice(&u16::try_from(total).unwrap().to_be_bytes());
    let mut tcp = vec![0u8; 20];
    tcp[0..2].copy_from_slice(&src.to_be_bytes());
    tcp[2..4].copy_from_slice(&dst.to_be_bytes());
    tcp[4..8].copy_from_slice(&seq.to_be_bytes());
    tcp[12] = 5 << 4;
    tcp[13] = if syn { 0x02 } else { 0x18 };
    f.extend(ip);
    f.extend(tcp);
    f.extend_from_slice(payload);
    f
}

fn pcap(frames: &[Vec<u8>]) -> Vec<u8> {
    let mut p = vec![0xd4, 0xc3, 0xb2, 0xa1, 2, 0, 4, 0];
    p.extend([0u8; 8]);
    p.extend(262_144u32.to_le_bytes());
    p.extend(1u32.to_le_bytes());
    for f in frames {
        p.extend([0u8; 8]);
        p.extend(u32::try_from(f.len()).unwrap().to_le_bytes());
        p.extend(u32::try_from(f.len()).unwrap().to_le_bytes());
        p.extend(f);
    }
    p
}

#[test]
fn streams_are_reassembled_in_order_and_holes_refused() {
    let frames = vec![
        frame(5000, 4420, 99, true, &[]),
        frame(5000, 4420, 103, false, b"defg"),
        frame(5000, 4420, 100, false, b"abc"),
        frame(5000, 4420, 100, false, b"abc"),
        frame(4420, 5000, 7, true, &[]),
        frame(4420, 5000, 8, false, b"xy"),
        frame(6000, 80, 1, false, b"not ours"),
    ];
    let s = streams(&pcap(&frames), 4420).unwrap();
    assert_eq!(s[&(5000, 4420, true)], b"abcdefg");
    assert_eq!(s[&(5000, 4420, false)], b"xy");
    assert_eq!(s.len(), 2);
    let holed = vec![
        frame(5000, 4420, 99, true, &[]),
        frame(5000, 4420, 105, false, b"zz"),
    ];
    assert!(streams(&pcap(&holed), 4420).is_err());
}
