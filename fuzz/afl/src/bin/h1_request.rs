//! AFL++ target: a request head, then its body read by the head's framing.
//! Never a panic; an accepted head is one httparse accepts, with the same
//! length.

use tidegate_h1::{parse_request, ChunkedDecoder, HeadLimits, RequestBody, RequestHead};

fn main() {
    let mut head = RequestHead::default();
    afl::fuzz!(|data: &[u8]| {
        if let Ok(Some(())) = parse_request(data, HeadLimits::default(), &mut head) {
            let mut headers = [httparse::EMPTY_HEADER; 100];
            let mut req = httparse::Request::new(&mut headers);
            assert_eq!(req.parse(data), Ok(httparse::Status::Complete(head.len)));
            if head.body == RequestBody::Chunked {
                drain(&data[head.len..]);
            }
        }
    });
}

fn drain(mut rest: &[u8]) {
    let mut d = ChunkedDecoder::default();
    while let Ok(step) = d.decode(rest) {
        assert!(step.consumed <= rest.len());
        if let Some(r) = &step.data {
            assert!(r.end <= step.consumed);
        }
        if step.done || step.consumed == 0 {
            break;
        }
        rest = &rest[step.consumed..];
    }
}
