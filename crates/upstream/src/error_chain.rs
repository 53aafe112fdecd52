//! An error and its causes on one line, for logs and answers.

use std::error::Error;
use std::fmt;

/// Displays an error followed by every error in its [`Error::source`]
/// chain, `outer: inner: innermost`. hyper's own message alone is often
/// just `client error (Connect)`; the causes say what went wrong.
///
/// A cause whose text is already the end of the text printed so far (an
/// error that repeats its source in its own message) is not repeated.
#[derive(Clone, Copy)]
pub struct ErrorChain<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut last = self.0.to_string();
        f.write_str(&last)?;
        let mut cause = self.0.source();
        while let Some(c) = cause {
            let text = c.to_string();
            if !last.ends_with(&text) {
                write!(f, ": {text}")?;
            }
            last = text;
            cause = c.source();
        }
        Ok(())
    }
}

impl fmt::Debug for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);

    impl fmt::Display for Layer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.0)
        }
    }

    impl Error for Layer {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            self.1.as_deref().map(|l| l as &(dyn Error + 'static))
        }
    }

    #[test]
    fn every_cause_is_printed_once_in_order() {
        let e = Layer("client error (Connect)", Some(Box::new(Layer("tcp connect error", None))));
        assert_eq!(ErrorChain(&e).to_string(), "client error (Connect): tcp connect error");
        assert_eq!(ErrorChain(&Layer("alone", None)).to_string(), "alone");
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let e = Layer("outer", Some(Box::new(Layer("middle", Some(Box::new(Layer("inner", None)))))));
        assert_eq!(format!("{:?}", ErrorChain(&e)), "outer: middle: inner");
        assert_eq!(ErrorChain(&io).to_string(), "refused");
    }

    #[test]
    fn a_cause_repeated_in_its_parents_text_is_not_printed_twice() {
        let e = Layer("reading: connection reset", Some(Box::new(Layer("connection reset", None))));
        assert_eq!(ErrorChain(&e).to_string(), "reading: connection reset");
    }
}
