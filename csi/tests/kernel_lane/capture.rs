//! Scenario 16's look at the wire: a pcap file of loopback traffic (tcpdump), the TCP streams
//! to one port reassembled by sequence number, and each stream told apart as plain NVMe/TCP
//! (its first PDU an ICReq in clear) or TLS (records from its first byte to its last).
//!
//! Invariants: a capture with a truncated packet or a hole in a stream is refused (the verdict
//! is only about bytes that were seen); a TLS stream is one whose every byte belongs to a TLS
//! record, so no NVMe/TCP PDU of it is in clear.

use std::collections::BTreeMap;

/// One direction of one TCP connection: (client port, server port, to the server).
pub(crate) type FlowKey = (u16, u16, bool);

/// The reassembled client-to-server and server-to-client bytes of every connection to `port`.
pub(crate) fn streams(pcap: &[u8], port: u16) -> Result<BTreeMap<FlowKey, Vec<u8>>, String> {
    let (le, body) = match pcap.get(..4) {
        Some([0xd4, 0xc3, 0xb2, 0xa1] | [0x4d, 0x3c, 0xb2, 0xa1]) => (true, &pcap[24..]),
        Some([0xa1, 0xb2, 0xc3, 0xd4] | [0xa1, 0xb2, 0x3c, 0x4d]) => (false, &pcap[24..]),
        _ => return Err("not a pcap file".into()),
    };
    let u32_at = |b: &[u8], at: usize| -> Option<u32> {
        let w: [u8; 4] = b.get(at..at + 4)?.try_into().ok()?;
        Some(if le {
            u32::from_le_bytes(w)
        } else {
            u32::from_be_bytes(w)
        })
    };
    let linktype = u32_at(pcap, 20).ok_or("short pcap header")?;
    if linktype != 1 {
        return Err(format!("link type {linktype}, not Ethernet (lo)"));
    }
    // Per direction: the initial sequence number and the segments by sequence number.
    let mut isn: BTreeMap<FlowKey, u32> = BTreeMap::new();
    let mut segs: BTreeMap<FlowKey, BTreeMap<u32, Vec<u8>>> = BTreeMap::new();
    let mut at = 0;
    while at < body.len() {
        let incl = u32_at(body, at + 8).ok_or("short record header")? as usize;
        let orig = u32_at(body, at + 12).ok_or("short record header")? as usize;
        if incl != orig {
            return Err(format!("a packet was truncated ({incl} of {orig} bytes)"));
        }
        let frame = body.get(at + 16..at + 16 + incl).ok_or("short record")?;
        at += 16 + incl;
        let Some((src, dst, seq, syn, payload)) = tcp_of(frame) else {
            continue;
        };
        let key = if dst == port {
            (src, dst, true)
        } else if src == port {
            (dst, src, false)
        } else {
            continue;
        };
        if syn {
            isn.insert(key, seq.wrapping_add(1));
        } else if !payload.is_empty() {
            segs.entry(key).or_default().insert(seq, payload.to_vec());
        }
    }
    let mut out = BTreeMap::new();
    for (key, parts) in segs {
        let start = *isn
            .get(&key)
            .ok_or_else(|| format!("flow {key:?}: its SYN was not captured"))?;
        let mut bytes = Vec::new();
        let mut next = start;
        // In sequence order from the first byte; retransmissions overlap what is there.
        let mut parts: Vec<(u32, Vec<u8>)> = parts
            .into_iter()
            .map(|(s, p)| (s.wrapping_sub(start), p))
            .collect::<Vec<_>>();
        parts.sort_by_key(|(off, _)| *off);
        for (off, p) in parts {
            let have = next.wrapping_sub(start);
            if off > have {
                return Err(format!("flow {key:?}: {} bytes missing", off - have));
            }
            let skip = (have - off) as usize;
            if skip < p.len() {
                bytes.extend_from_slice(&p[skip..]);
                next = next.wrapping_add(u32::try_from(p.len() - skip).unwrap_or(u32::MAX));
            }
        }
        out.insert(key, bytes);
    }
    Ok(out)
}

/// Source and destination ports, sequence number, SYN and payload of an IPv4 TCP frame.
fn tcp_of(frame: &[u8]) -> Option<(u16, u16, u32, bool, &[u8])> {
    let be16 = |b: &[u8], at: usize| Some(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?));
    if be16(frame, 12)? != 0x0800 {
        return None;
    }
    let ip = frame.get(14..)?;
    let ihl = usize::from(ip.first()? & 0x0f) * 4;
    if *ip.get(9)? != 6 {
        return None;
    }
    let total = usize::from(be16(ip, 2)?);
    let tcp = ip.get(ihl..total)?;
    let off = usize::from(tcp.get(12)? >> 4) * 4;
    let seq = u32::from_be_bytes(tcp.get(4..8)?.try_into().ok()?);
    let syn = tcp.get(13)? & 0x02 != 0;
    Some((be16(tcp, 0)?, be16(tcp, 2)?, seq, syn, tcp.get(off..)?))
}

/// What a stream's bytes are.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Seen {
    /// Its first PDU is an NVMe/TCP ICReq in clear (type 0, header and PDU length 128).
    PlainNvmeTcp,
    /// TLS records from the first byte to the last (the last may be cut by the capture's end).
    Tls { records: usize, bytes: usize },
    /// Neither.
    Other,
}

/// Tells `bytes` apart.
pub(crate) fn classify(bytes: &[u8]) -> Seen {
    if bytes.len() >= 8 && bytes[0] == 0x00 && bytes[2] == 128 && bytes[4..8] == [128, 0, 0, 0] {
        return Seen::PlainNvmeTcp;
    }
    let mut at = 0;
    let mut records = 0;
    while at + 5 <= bytes.len() {
        let (kind, major) = (bytes[at], bytes[at + 1]);
        if !(0x14..=0x17).contains(&kind) || major != 0x03 {
            return Seen::Other;
        }
        let len = usize::from(u16::from_be_bytes([bytes[at + 3], bytes[at + 4]]));
        if len > (1 << 14) + 256 {
            return Seen::Other;
        }
        at += 5 + len;
        records += 1;
    }
    if records == 0 {
        return Seen::Other;
    }
    Seen::Tls {
        records,
        bytes: bytes.len(),
    }
}
