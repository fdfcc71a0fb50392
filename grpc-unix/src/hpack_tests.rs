//! The HPACK decoder's tests: the RFC's examples, its table rules, and agreement with an
//! independent decoder on generated blocks.

use super::*;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn fields(d: &mut Decoder, block: &[u8]) -> Result<Vec<(String, String)>, Malformed> {
    let mut out = Vec::new();
    d.decode(block, |n, v| {
        out.push((
            String::from_utf8_lossy(n).into_owned(),
            String::from_utf8_lossy(v).into_owned(),
        ));
        Ok::<(), ()>(())
    })
    .map_err(|e| match e {
        DecodeError::Malformed(m) => m,
        DecodeError::Stopped(()) => unreachable!("the callback never stops"),
    })?;
    Ok(out)
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}

#[test]
fn the_rfc_request_examples_decode_with_their_table() {
    // RFC 7541 C.3 (literals) and C.4 (the same requests Huffman-coded): three requests on one
    // connection each, the table carried from one to the next.
    for blocks in [
        [
            "828684410f7777772e6578616d706c652e636f6d",
            "828684be58086e6f2d6361636865",
            "828785bf400a637573746f6d2d6b65790c637573746f6d2d76616c7565",
        ],
        [
            "828684418cf1e3c2e5f23a6ba0ab90f4ff",
            "828684be5886a8eb10649cbf",
            "828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf",
        ],
    ] {
        let mut d = Decoder::new(4096);
        let first = [
            (":method", "GET"),
            (":scheme", "http"),
            (":path", "/"),
            (":authority", "www.example.com"),
        ];
        assert_eq!(fields(&mut d, &hex(blocks[0])).unwrap(), pairs(&first));
        assert_eq!(d.size, 57);
        let mut second = first.to_vec();
        second.push(("cache-control", "no-cache"));
        assert_eq!(fields(&mut d, &hex(blocks[1])).unwrap(), pairs(&second));
        assert_eq!(d.size, 110);
        let third = [
            (":method", "GET"),
            (":scheme", "https"),
            (":path", "/index.html"),
            (":authority", "www.example.com"),
            ("custom-key", "custom-value"),
        ];
        assert_eq!(fields(&mut d, &hex(blocks[2])).unwrap(), pairs(&third));
        assert_eq!(d.size, 164);
        assert_eq!(d.table.len(), 3);
    }
}

#[test]
fn entries_are_evicted_oldest_first_and_a_too_large_one_empties_the_table() {
    let mut d = Decoder::new(100);
    // Each entry "aaaa: bbbb" is 4 + 4 + 32 = 40 bytes: two fit in 100, the third evicts one.
    let block = |name: &str| {
        let mut b = vec![0x40, 0x04];
        b.extend(name.as_bytes());
        b.push(0x04);
        b.extend(b"bbbb");
        b
    };
    fields(&mut d, &block("aaaa")).unwrap();
    fields(&mut d, &block("cccc")).unwrap();
    fields(&mut d, &block("dddd")).unwrap();
    assert_eq!(d.size, 80);
    // Index 62 is the newest, 63 the one before; 64 was evicted.
    assert_eq!(
        fields(&mut d, &[0xbe, 0xbf]).unwrap(),
        pairs(&[("dddd", "bbbb"), ("cccc", "bbbb")])
    );
    assert_eq!(fields(&mut d, &[0xc0]), Err(Malformed::Index(64)));
    // An entry of 32 + 70 bytes does not fit: the table is emptied, the field still decodes.
    let mut big = vec![0x40, 0x02, b'x', b'y', 0x44];
    big.extend([b'v'; 68]);
    assert_eq!(fields(&mut d, &big).unwrap().len(), 1);
    assert_eq!((d.size, d.table.len()), (0, 0));
    // A size update shrinks the table at once, and one above the limit is refused.
    fields(&mut d, &block("aaaa")).unwrap();
    fields(&mut d, &[0x20]).unwrap();
    assert_eq!((d.size, d.table.len()), (0, 0));
    assert_eq!(
        fields(&mut d, &[0x3f, 0x46]),
        Err(Malformed::SizeUpdateTooLarge {
            size: 101,
            limit: 100
        })
    );
}

#[test]
fn malformed_blocks_are_refused_with_their_reason() {
    let mut d = Decoder::new(4096);
    assert_eq!(fields(&mut d, &[0x80]), Err(Malformed::Index(0)));
    assert_eq!(fields(&mut d, &[0xbe]), Err(Malformed::Index(62)));
    assert_eq!(fields(&mut d, &[0xff]), Err(Malformed::Integer));
    assert_eq!(
        fields(&mut d, &[0x40, 0x05, b'a']),
        Err(Malformed::StringTruncated)
    );
    assert_eq!(
        fields(&mut d, &[0x00, 0x81, 0x00, 0x00]),
        Err(Malformed::Huffman(HuffmanError::PaddingNotOnes))
    );
    // A name index past the table, in a literal.
    assert_eq!(
        fields(&mut d, &[0x0f, 0x30, 0x00]),
        Err(Malformed::Index(63))
    );
}

#[test]
fn a_caller_stops_a_block_of_references_without_a_copy_per_reference() {
    // One 4,000-byte entry, then 1-byte references to it: the caller sees each as a borrow of
    // the entry and stops at its bound, so the block costs a count per field.
    let mut d = Decoder::new(4096);
    let mut block = vec![0x40, 0x01, b'x'];
    encode_prefixed(&mut block, 0x00, 7, 4000);
    block.extend([b'v'; 4000]);
    block.extend([0xbe; 1000]);
    let mut seen = 0_usize;
    let mut size = 0_usize;
    let mut entry_value: Option<*const u8> = None;
    let result = d.decode(&block, |name, value| {
        if seen > 0 {
            // Every reference hands over the table's own bytes, the same each time.
            assert_eq!(*entry_value.get_or_insert(value.as_ptr()), value.as_ptr());
        }
        seen += 1;
        size += name.len() + value.len() + 32;
        if size > 16 * 1024 {
            Err("bound")
        } else {
            Ok(())
        }
    });
    assert_eq!(result, Err(DecodeError::Stopped("bound")));
    assert_eq!(seen, 5);
}

/// A block of fields as an encoder may write them, from a seed: every representation, table
/// references to what earlier fields added, Huffman-coded or literal strings, size updates at
/// the start.
fn generated_block(state: &mut u64, table_len: &mut usize) -> Vec<u8> {
    let mut next = || {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        usize::try_from(*state >> 33).expect("31 bits fit")
    };
    let mut block = Vec::new();
    if next() % 8 == 0 {
        let size = next() % 4097;
        encode_prefixed(&mut block, 0x20, 5, size);
        if size < 200 {
            *table_len = 0;
        }
    }
    let names: [&[u8]; 5] = [
        b":authority",
        b"content-type",
        b"x-long",
        b"te",
        b"grpc-timeout",
    ];
    // At least one field: the reference refuses a block of size updates alone, which the RFC
    // allows (and so does this decoder).
    for _ in 0..=(next() % 12) {
        let string = |block: &mut Vec<u8>, s: &[u8], huffman: bool| {
            if huffman {
                let mut h = Vec::new();
                httlib_huffman::encode(s, &mut h).unwrap();
                encode_prefixed(block, 0x80, 7, h.len());
                block.extend(h);
            } else {
                encode_prefixed(block, 0x00, 7, s.len());
                block.extend(s);
            }
        };
        let kind = next() % 4;
        let index = 1 + (next() % (61 + *table_len));
        match kind {
            0 => encode_prefixed(&mut block, 0x80, 7, index),
            _ => {
                let (first, prefix) = [(0x40, 6), (0x00, 4), (0x10, 4)][kind - 1];
                if next() % 2 == 0 {
                    encode_prefixed(&mut block, first, prefix, index);
                } else {
                    encode_prefixed(&mut block, first, prefix, 0);
                    let name = names[next() % names.len()];
                    string(&mut block, name, next() % 2 == 0);
                }
                let len = if next() % 5 == 0 { 300 } else { next() % 20 };
                let value: Vec<u8> = (0..len)
                    .map(|_| u8::try_from(next() % 256).expect("below 256"))
                    .collect();
                string(&mut block, &value, next() % 2 == 0);
                if kind == 1 {
                    *table_len += 1;
                }
            }
        }
    }
    block
}

fn encode_prefixed(out: &mut Vec<u8>, first: u8, prefix: u32, value: usize) {
    crate::rewrite::encode_integer(out, first, prefix, value);
}

#[test]
fn this_decoder_agrees_with_an_independent_one_on_generated_connections() {
    // The reference: the HPACK crate the rewriter used before (a dev-dependency). It takes a
    // size update anywhere, so the generator puts them only at the start, where both must.
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let (mut compared, mut decoded) = (0, 0);
    for _connection in 0..80 {
        let mut mine = Decoder::new(4096);
        let mut reference = loona_hpack::Decoder::new();
        reference.set_max_allowed_table_size(4096);
        // An upper bound of the table's length (references past it are refused by both).
        let mut table_len = 0;
        for _block in 0..20 {
            let block = generated_block(&mut state, &mut table_len);
            let got = fields(&mut mine, &block);
            let want = reference.decode(&block).map(|list| {
                list.into_iter()
                    .map(|(n, v)| {
                        (
                            String::from_utf8_lossy(&n).into_owned(),
                            String::from_utf8_lossy(&v).into_owned(),
                        )
                    })
                    .collect::<Vec<_>>()
            });
            assert_eq!(
                got.is_ok(),
                want.is_ok(),
                "block {block:02x?}: {got:?} {want:?}"
            );
            compared += 1;
            match (got, want) {
                (Ok(g), Ok(w)) => {
                    assert_eq!(g, w);
                    decoded += 1;
                }
                // After an error the connection is closed: both states are moot.
                _ => break,
            }
        }
    }
    // Most blocks decode: the comparison is about fields, not only about refusals.
    assert!(
        decoded > 600 && compared > 800,
        "{decoded} of {compared} blocks decoded"
    );
}
