//! AFL++ target: chunked decoding, whole and split at a point the input's
//! first byte chooses: both readings agree (payload, end, failure).

use tidegate_h1::ChunkedDecoder;

fn read(parts: &[&[u8]]) -> (Vec<u8>, bool, bool) {
    let mut d = ChunkedDecoder::default();
    let mut payload = Vec::new();
    let mut buf: Vec<u8> = Vec::new();
    for part in parts {
        buf.extend_from_slice(part);
        loop {
            match d.decode(&buf) {
                Err(_) => return (payload, false, true),
                Ok(step) => {
                    if let Some(r) = &step.data {
                        payload.extend_from_slice(&buf[r.clone()]);
                    }
                    buf.drain(..step.consumed);
                    if step.done {
                        return (payload, true, false);
                    }
                    if step.consumed == 0 {
                        break;
                    }
                }
            }
        }
    }
    (payload, false, false)
}

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Some((&cut, body)) = data.split_first() else { return };
        let at = usize::from(cut).min(body.len());
        assert_eq!(read(&[body]), read(&[&body[..at], &body[at..]]));
    });
}
