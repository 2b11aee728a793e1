//! What any cache could have served each request of a replay: the longest
//! run of its prompt's leading tokens that an earlier prompt of the cut
//! began with, all but its last token (which every server computes, for
//! its logits). Counted in the prompts the servers see, so it sits beside
//! their hit rates as is.

use std::collections::HashMap;

use super::Prepared;

/// Per request of `requests` (in cut order), its bound in tokens.
pub(super) fn per_request(requests: &[Prepared]) -> Vec<usize> {
    // A trie of every prompt sent before: (node, token) -> child node.
    let mut trie: HashMap<(u32, u32), u32> = HashMap::new();
    let mut nodes: u32 = 1;
    requests
        .iter()
        .map(|r| {
            let mut node = 0;
            let mut shared = 0;
            let mut known = true;
            for &t in &r.prompt {
                if known && let Some(&next) = trie.get(&(node, t)) {
                    node = next;
                    shared += 1;
                    continue;
                }
                known = false;
                trie.insert((node, t), nodes);
                node = nodes;
                nodes += 1;
            }
            shared.min(r.prompt.len().saturating_sub(1))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(prompt: &[u32]) -> Prepared {
        Prepared {
            index: 0,
            session: None,
            time_s: 0.0,
            prompt: prompt.to_vec(),
            max_tokens: 2,
        }
    }

    #[test]
    fn a_prompt_is_bounded_by_its_longest_prefix_sent_before_less_its_last_token() {
        let b = per_request(&[
            req(&[1, 2, 3, 4]),
            req(&[1, 2, 9]),
            req(&[1, 2, 3, 4]),
            req(&[1, 2, 9, 7, 7]),
            req(&[5]),
        ]);
        assert_eq!(b, vec![0, 2, 3, 3, 0]);
    }
}
