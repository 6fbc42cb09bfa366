//! Splits a byte stream into JSON messages (objects or arrays) without parsing them:
//! tracks bracket depth outside strings, so a message is complete at the bracket
//! that closes its first one. Whitespace between messages is skipped. The parser
//! (serde_json) then judges each message on its own.

pub enum Push {
    /// Everything given was consumed; the message is not complete yet.
    More,
    Message(Vec<u8>),
    /// The message under way passed the size limit.
    TooLarge,
    /// A byte between messages that cannot start one.
    Junk(u8),
}

pub struct Framer {
    max: usize,
    buf: Vec<u8>,
    depth: usize,
    in_str: bool,
    esc: bool,
}

impl Framer {
    pub fn new(max: usize) -> Framer {
        Framer {
            max,
            buf: Vec::new(),
            depth: 0,
            in_str: false,
            esc: false,
        }
    }

    /// Whether a message has started and is not complete yet.
    pub fn in_message(&self) -> bool {
        self.depth > 0
    }

    /// Consumes bytes up to the end of the next complete message (or all of
    /// `data`); returns how many it consumed and what happened.
    pub fn push(&mut self, data: &[u8]) -> (usize, Push) {
        for (i, &b) in data.iter().enumerate() {
            if self.depth == 0 {
                match b {
                    b' ' | b'\t' | b'\r' | b'\n' => continue,
                    b'{' | b'[' => {}
                    _ => return (i + 1, Push::Junk(b)),
                }
            }
            if self.buf.len() >= self.max {
                return (i + 1, Push::TooLarge);
            }
            self.buf.push(b);
            if self.in_str {
                if self.esc {
                    self.esc = false;
                } else if b == b'\\' {
                    self.esc = true;
                } else if b == b'"' {
                    self.in_str = false;
                }
                continue;
            }
            match b {
                b'"' => self.in_str = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' => {
                    self.depth -= 1;
                    if self.depth == 0 {
                        return (i + 1, Push::Message(std::mem::take(&mut self.buf)));
                    }
                }
                _ => {}
            }
        }
        (data.len(), Push::More)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(f: &mut Framer, mut d: &[u8]) -> Vec<String> {
        let mut out = Vec::new();
        while !d.is_empty() {
            let (n, p) = f.push(d);
            d = &d[n..];
            match p {
                Push::Message(m) => out.push(String::from_utf8(m).unwrap()),
                Push::More => {}
                Push::TooLarge => {
                    out.push("TOO LARGE".into());
                    break;
                }
                Push::Junk(b) => {
                    out.push(format!("JUNK {}", b as char));
                    break;
                }
            }
        }
        out
    }

    #[test]
    fn back_to_back_newlines_and_split_reads() {
        let mut f = Framer::new(1 << 20);
        let msgs = all(&mut f, b"{\"a\":\"}{\\\"\"}{\"b\":[1,{}]}\n  [{}]\n{\"c\":");
        assert_eq!(msgs, ["{\"a\":\"}{\\\"\"}", "{\"b\":[1,{}]}", "[{}]"]);
        assert_eq!(all(&mut f, b"2}"), ["{\"c\":2}"]);
        assert_eq!(all(&mut f, b" x"), ["JUNK x"]);
        let mut f = Framer::new(8);
        assert_eq!(all(&mut f, b"{\"aaaaaaaaaaa\"}"), ["TOO LARGE"]);
    }
}
