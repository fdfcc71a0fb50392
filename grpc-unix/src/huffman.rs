//! Decoding of HPACK's Huffman-coded strings (RFC 7541 5.2, the code of its Appendix B).
//!
//! The decoding table is built once per process from the code table and shared by every
//! connection: decoding a string costs a few instructions per bit and allocates nothing but
//! what the output needs (the HPACK crate this replaced built a table of hash maps for every
//! string it decoded, about 20,000 instructions each).
//!
//! Invariants:
//! - A string decodes only as the RFC allows: no EOS symbol inside it, at most 7 bits of
//!   padding after its last symbol, and the padding is the most significant bits of EOS (all
//!   ones). Anything else is an error, as the server's own decoder would answer.
//! - The output grows by one byte per decoded symbol and at most `8 * input / 5` (the shortest
//!   code has 5 bits): bounded by the input.

use std::sync::OnceLock;

/// The longest code (EOS's).
const MAX_CODE_LEN: usize = 30;
/// The symbol that ends a string, never part of one.
const EOS: u16 = 256;

/// Why a Huffman-coded string does not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HuffmanError {
    /// The string holds the EOS symbol.
    #[error("Huffman-coded string holds EOS")]
    Eos,
    /// More than 7 bits after the last symbol.
    #[error("Huffman-coded string has more than 7 bits of padding")]
    PaddingTooLong,
    /// The padding is not the most significant bits of EOS.
    #[error("Huffman-coded string's padding is not all ones")]
    PaddingNotOnes,
}

/// The codes of one length, sorted, each with its symbol.
#[derive(Debug, Default)]
struct Length {
    codes: Vec<(u32, u16)>,
}

/// The decoding table: for each code length, its codes.
#[derive(Debug)]
struct Table {
    by_len: [Length; MAX_CODE_LEN + 1],
}

impl Table {
    fn build() -> Self {
        let mut by_len: [Length; MAX_CODE_LEN + 1] = std::array::from_fn(|_| Length::default());
        for (symbol, &(len, code)) in httlib_huffman::encoder::table::ENCODE_TABLE
            .iter()
            .enumerate()
        {
            let symbol = u16::try_from(symbol).expect("257 symbols fit in u16");
            by_len[usize::from(len)].codes.push((code, symbol));
        }
        for length in &mut by_len {
            length.codes.sort_unstable();
        }
        Self { by_len }
    }

    /// The symbol whose code is the `len` bits of `code`, if any.
    fn symbol(&self, code: u32, len: usize) -> Option<u16> {
        let codes = &self.by_len[len].codes;
        codes
            .binary_search_by_key(&code, |&(c, _)| c)
            .ok()
            .map(|i| codes[i].1)
    }
}

fn table() -> &'static Table {
    static TABLE: OnceLock<Table> = OnceLock::new();
    TABLE.get_or_init(Table::build)
}

/// Appends the decoding of `input` to `out`.
pub fn decode(input: &[u8], out: &mut Vec<u8>) -> Result<(), HuffmanError> {
    let table = table();
    let mut code: u32 = 0;
    let mut len = 0_usize;
    for &byte in input {
        for shift in (0..8).rev() {
            code = (code << 1) | u32::from((byte >> shift) & 1);
            len += 1;
            if let Some(symbol) = table.symbol(code, len) {
                if symbol == EOS {
                    return Err(HuffmanError::Eos);
                }
                out.push(u8::try_from(symbol).expect("every symbol but EOS is a byte"));
                code = 0;
                len = 0;
            } else if len >= MAX_CODE_LEN {
                // Every 30-bit sequence is EOS or has a shorter prefix that is a code: the code
                // is complete, so this is reached only if the table were not.
                return Err(HuffmanError::Eos);
            }
        }
    }
    if len > 7 {
        return Err(HuffmanError::PaddingTooLong);
    }
    if code != (1 << len) - 1 {
        return Err(HuffmanError::PaddingNotOnes);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(s: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        httlib_huffman::encode(s, &mut out).expect("any bytes encode");
        out
    }

    #[test]
    fn every_byte_round_trips_alone_and_in_a_string() {
        for b in 0..=255u8 {
            let mut out = Vec::new();
            decode(&encode(&[b]), &mut out).unwrap();
            assert_eq!(out, [b]);
        }
        let all: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).collect();
        let mut out = Vec::new();
        decode(&encode(&all), &mut out).unwrap();
        assert_eq!(out, all);
    }

    #[test]
    fn the_rfc_examples_decode() {
        // RFC 7541 C.4.1: "www.example.com".
        let input = [
            0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff,
        ];
        let mut out = Vec::new();
        decode(&input, &mut out).unwrap();
        assert_eq!(out, b"www.example.com");
        // RFC 7541 C.4.2: "no-cache".
        let mut out = Vec::new();
        decode(&[0xa8, 0xeb, 0x10, 0x64, 0x9c, 0xbf], &mut out).unwrap();
        assert_eq!(out, b"no-cache");
    }

    #[test]
    fn padding_and_eos_are_refused_as_the_rfc_says() {
        // '0' is 00000 (5 bits): 3 bits of padding, all ones.
        let mut out = Vec::new();
        decode(&[0b0000_0111], &mut out).unwrap();
        assert_eq!(out, b"0");
        // The same padding with a zero in it.
        assert_eq!(
            decode(&[0b0000_0110], &mut Vec::new()),
            Err(HuffmanError::PaddingNotOnes)
        );
        // A whole byte of ones after a complete symbol is 8 bits of padding.
        assert_eq!(
            decode(&[0b0000_0111, 0xff], &mut Vec::new()),
            Err(HuffmanError::PaddingTooLong)
        );
        // EOS (30 ones) spelled out, then padding.
        assert_eq!(
            decode(&[0xff, 0xff, 0xff, 0xff], &mut Vec::new()),
            Err(HuffmanError::Eos)
        );
        // An empty string is valid.
        decode(&[], &mut Vec::new()).unwrap();
    }

    #[test]
    fn this_decoder_agrees_with_the_reference_on_arbitrary_input() {
        // The reference: the HPACK crate's decoder the rewriter used before (a dev-dependency).
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        for round in 0..3000 {
            let len = round % 24;
            let input: Vec<u8> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    // Mostly ones, so that long codes and padding are reached often.
                    state.to_le_bytes()[0] | if round % 2 == 0 { 0xc0 } else { 0 }
                })
                .collect();
            let mut mine = Vec::new();
            let mine = decode(&input, &mut mine).map(|()| mine);
            let reference = loona_hpack::huffman::HuffmanDecoder::new().decode(&input);
            assert_eq!(mine.is_ok(), reference.is_ok(), "input {input:02x?}");
            if let (Ok(m), Ok(r)) = (mine, reference) {
                assert_eq!(m, r, "input {input:02x?}");
            }
        }
    }
}
