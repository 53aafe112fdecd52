//! AFL++ target: a response head (to GET and to HEAD). Never a panic; an
//! accepted head is one httparse accepts, with the same length.

use tidegate_h1::{parse_response, HeadLimits, ResponseHead};

fn main() {
    let mut head = ResponseHead::default();
    afl::fuzz!(|data: &[u8]| {
        for to_head in [false, true] {
            if let Ok(Some(())) = parse_response(data, HeadLimits::default(), to_head, &mut head) {
                let mut headers = [httparse::EMPTY_HEADER; 100];
                let mut resp = httparse::Response::new(&mut headers);
                assert_eq!(resp.parse(data), Ok(httparse::Status::Complete(head.len)));
                assert!((100..=599).contains(&head.code));
            }
        }
    });
}
