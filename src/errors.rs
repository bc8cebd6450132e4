//! How an error is told in one line with its causes: transport errors keep what a user acts on (connection
//! refused, a DNS failure, a certificate the system does not trust) in their causes, not in their own text.

use std::error::Error;

/// The error's text, then each cause whose text it does not already hold, joined by ": ".
pub fn chain(err: &dyn Error) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(c) = cause {
        let said = c.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl Error for Layer {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            self.1.as_deref().map(|l| l as &(dyn Error + 'static))
        }
    }

    #[test]
    fn causes_follow_the_error_once_each() {
        let refused = Layer("Connection refused (os error 111)", None);
        let connect = Layer("tcp connect error", Some(Box::new(refused)));
        let sending = Layer("error sending request for url (http://h/api)", Some(Box::new(connect)));
        // The outer error quotes the next one's text already: it is not said twice.
        let outer = Layer("HTTP request error: error sending request for url (http://h/api)", Some(Box::new(sending)));
        assert_eq!(
            chain(&outer),
            "HTTP request error: error sending request for url (http://h/api): tcp connect error: Connection refused (os error 111)"
        );
        assert_eq!(chain(&Layer("alone", None)), "alone");
    }
}
