//! The order of a wait queue, fair between clients: pure bookkeeping, no
//! locks, wakers or clocks (the [`WaitQueue`](super::WaitQueue) around it
//! has those).
//!
//! Each client (a key: the queue's user passes the client's address) has
//! its own first-in, first-out line, and the clients that have someone
//! waiting take turns: [`Line::pop`] takes the first of the client whose
//! turn it is, then that client goes to the back of the turns. When the
//! line is full, a newcomer whose client holds at least two fewer places
//! than the client holding the most takes that client's newest place
//! ([`Joined::displaced`]) instead of being refused; with one fewer, the
//! exchange would only swap which of two equal clients is refused.
//!
//! Every operation is O(1) (a hash lookup of the client and a few links),
//! except [`Line::requeue`], which walks past the client's own places that
//! were requeued before it (at most the requests woken at once). Places
//! live in a vector reused through a free list: the line allocates only
//! when it grows past its largest size so far.

use std::collections::HashMap;
use std::hash::Hash;

/// No index: the end of a list.
const NIL: u32 = u32::MAX;

/// A place in a [`Line`], valid until it leaves the line (a later place
/// that reuses its slot has another generation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handle {
    index: u32,
    generation: u32,
}

impl Handle {
    /// Stands for "no place" in [`Handle::to_bits`]'s encoding.
    pub const NONE_BITS: u64 = u64::MAX;

    /// The handle as one integer (for an atomic beside the waiter).
    pub fn to_bits(self) -> u64 {
        (u64::from(self.index) << 32) | u64::from(self.generation)
    }

    /// The handle [`Handle::to_bits`] encoded, `None` for
    /// [`Handle::NONE_BITS`].
    pub fn from_bits(bits: u64) -> Option<Handle> {
        (bits != Self::NONE_BITS).then_some(Handle { index: (bits >> 32) as u32, generation: bits as u32 })
    }
}

/// A newcomer's place.
#[derive(Debug, PartialEq, Eq)]
pub struct Joined<T> {
    /// Its place.
    pub handle: Handle,
    /// Its order of arrival, kept if it is requeued.
    pub seq: u64,
    /// It is the next to be popped.
    pub first: bool,
    /// The newest waiter of the client holding the most places, out of the
    /// line to make room for this one.
    pub displaced: Option<T>,
}

#[derive(Debug)]
struct Node<T> {
    item: Option<T>,
    seq: u64,
    generation: u32,
    client: u32,
    /// In the client's line; a free node's `next` is the next free one.
    prev: u32,
    next: u32,
}

#[derive(Debug, Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
}

const UNLINKED: Link = Link { prev: NIL, next: NIL };

#[derive(Debug)]
struct Client<K> {
    key: K,
    /// Its places, oldest first.
    head: u32,
    tail: u32,
    /// How many; 0: a free slot, whose `turns.next` is the next free one.
    count: u32,
    /// In the order of turns.
    turns: Link,
    /// Among the clients holding as many places.
    bucket: Link,
}

/// Which list of clients.
#[derive(Debug, Clone, Copy)]
enum Chain {
    Turns,
    Bucket,
}

/// Waiters keyed by client, taken in turns between clients and in order
/// within one.
#[derive(Debug)]
pub struct Line<K, T> {
    nodes: Vec<Node<T>>,
    free_node: u32,
    clients: Vec<Client<K>>,
    free_client: u32,
    by_key: HashMap<K, u32, foldhash::fast::RandomState>,
    /// Clients with places, in the order of their turns.
    turns_head: u32,
    turns_tail: u32,
    /// `buckets[n]`: the first of the clients holding `n` places.
    buckets: Vec<u32>,
    /// The most places a client holds (0: empty).
    top: u32,
    len: usize,
    next_seq: u64,
}

impl<K, T> Default for Line<K, T> {
    fn default() -> Self {
        Line {
            nodes: Vec::new(),
            free_node: NIL,
            clients: Vec::new(),
            free_client: NIL,
            by_key: HashMap::default(),
            turns_head: NIL,
            turns_tail: NIL,
            buckets: Vec::new(),
            top: 0,
            len: 0,
            next_seq: 0,
        }
    }
}

impl<K: Copy + Eq + Hash, T> Line<K, T> {
    /// Places taken.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Clients holding at least one place.
    pub fn clients(&self) -> usize {
        self.by_key.len()
    }

    /// Places `key` holds.
    pub fn count_of(&self, key: &K) -> usize {
        self.by_key.get(key).map_or(0, |&c| self.clients[c as usize].count as usize)
    }

    /// The place [`Line::pop`] takes next.
    pub fn front(&self) -> Option<Handle> {
        let c = self.clients.get(self.turns_head as usize)?;
        Some(self.handle(c.head))
    }

    /// Queues `item` of client `key` behind that client's other places.
    /// When `max` places are taken already, the newest place of the client
    /// holding the most is given to it if `key` holds at least two fewer;
    /// otherwise `item` is handed back (the line is full for it).
    pub fn push_back(&mut self, key: K, item: T, max: usize) -> Result<Joined<T>, T> {
        if self.out_of_indices() {
            return Err(item);
        }
        let mut displaced = None;
        if self.len >= max {
            let mine = self.count_of(&key) as u64;
            if max == 0 || mine + 1 >= u64::from(self.top) {
                return Err(item);
            }
            let greedy = self.buckets[self.top as usize];
            let newest = self.clients[greedy as usize].tail;
            displaced = self.take(newest);
        }
        let c = self.client(key, false);
        let seq = self.next_seq;
        self.next_seq += 1;
        let tail = self.clients[c as usize].tail;
        let handle = self.insert(c, item, seq, tail, NIL);
        let first = self.front() == Some(handle);
        Ok(Joined { handle, seq, first, displaced })
    }

    /// Puts back `item` of client `key`, taken out by [`Line::pop`] (or
    /// [`Line::remove`] of the first place), as the next to be popped: its
    /// client takes the current turn, and within the client it goes back
    /// to its order of arrival `seq`. Never refused: the place was granted
    /// already. `None` only if the line can hold no more places at all
    /// (4 billion).
    pub fn requeue(&mut self, key: K, item: T, seq: u64) -> Option<Handle> {
        if self.out_of_indices() {
            return None;
        }
        let c = self.client(key, true);
        // Behind the client's places that arrived before it (others
        // requeued meanwhile), ahead of the rest.
        let mut before = self.clients[c as usize].head;
        let mut after = NIL;
        while before != NIL && self.nodes[before as usize].seq < seq {
            after = before;
            before = self.nodes[before as usize].next;
        }
        Some(self.insert(c, item, seq, after, before))
    }

    /// Takes the place `handle` out of the line: its item, and whether it
    /// was the first. `None` when the place has left already.
    pub fn remove(&mut self, handle: Handle) -> Option<(T, bool)> {
        let node = self.nodes.get(handle.index as usize)?;
        if node.generation != handle.generation || node.item.is_none() {
            return None;
        }
        let first = self.front() == Some(handle);
        Some((self.take(handle.index)?, first))
    }

    /// Takes the first place of the client whose turn it is; that client
    /// then goes to the back of the turns.
    pub fn pop(&mut self) -> Option<T> {
        let c = self.turns_head;
        let head = self.clients.get(c as usize)?.head;
        let item = self.take(head)?;
        if self.clients[c as usize].count > 0 && self.turns_tail != c {
            self.unlink(Chain::Turns, c);
            self.link_back(c);
        }
        Some(item)
    }

    /// Whether no index is left for another place (4 billion taken). A
    /// client holds a place, so there are never more clients than places.
    fn out_of_indices(&self) -> bool {
        self.free_node == NIL && self.nodes.len() >= NIL as usize
    }

    fn handle(&self, index: u32) -> Handle {
        Handle { index, generation: self.nodes[index as usize].generation }
    }

    /// The client slot of `key`, made if it holds no place yet; first in
    /// turn when `front`, else (if made) last. The caller gives it a place
    /// at once.
    fn client(&mut self, key: K, front: bool) -> u32 {
        if let Some(&c) = self.by_key.get(&key) {
            if front && self.turns_head != c {
                self.unlink(Chain::Turns, c);
                self.link_front(c);
            }
            return c;
        }
        let c = if self.free_client != NIL {
            let c = self.free_client;
            self.free_client = self.clients[c as usize].turns.next;
            self.clients[c as usize] =
                Client { key, head: NIL, tail: NIL, count: 0, turns: UNLINKED, bucket: UNLINKED };
            c
        } else {
            // Fewer clients than places (`out_of_indices` checked): fits.
            let c = self.clients.len() as u32;
            self.clients.push(Client { key, head: NIL, tail: NIL, count: 0, turns: UNLINKED, bucket: UNLINKED });
            c
        };
        self.by_key.insert(key, c);
        if front {
            self.link_front(c);
        } else {
            self.link_back(c);
        }
        c
    }

    /// Links a new node of client `c` between `prev` and `next` (NIL: the
    /// ends) of its line (`out_of_indices` was checked).
    fn insert(&mut self, c: u32, item: T, seq: u64, prev: u32, next: u32) -> Handle {
        let index = if self.free_node != NIL {
            let i = self.free_node;
            let node = &mut self.nodes[i as usize];
            self.free_node = node.next;
            node.item = Some(item);
            node.seq = seq;
            node.client = c;
            node.prev = prev;
            node.next = next;
            i
        } else {
            let i = self.nodes.len() as u32;
            self.nodes.push(Node { item: Some(item), seq, generation: 0, client: c, prev, next });
            i
        };
        match prev {
            NIL => self.clients[c as usize].head = index,
            p => self.nodes[p as usize].next = index,
        }
        match next {
            NIL => self.clients[c as usize].tail = index,
            n => self.nodes[n as usize].prev = index,
        }
        self.len += 1;
        self.recount(c, 1);
        self.handle(index)
    }

    /// Unlinks the taken node `index`, frees it and gives its item back;
    /// its client leaves the turns when it holds no more places. `None`
    /// (nothing changed) if the node is free.
    fn take(&mut self, index: u32) -> Option<T> {
        let node = self.nodes.get_mut(index as usize)?;
        let item = node.item.take()?;
        let (c, prev, next) = (node.client, node.prev, node.next);
        node.generation = node.generation.wrapping_add(1);
        node.next = self.free_node;
        self.free_node = index;
        match prev {
            NIL => self.clients[c as usize].head = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.clients[c as usize].tail = prev,
            n => self.nodes[n as usize].prev = prev,
        }
        self.len -= 1;
        self.recount(c, -1);
        if self.clients[c as usize].count == 0 {
            self.unlink(Chain::Turns, c);
            let key = self.clients[c as usize].key;
            self.by_key.remove(&key);
            self.clients[c as usize].turns.next = self.free_client;
            self.free_client = c;
        }
        Some(item)
    }

    /// Moves client `c` from its count's bucket to the next one up or down.
    fn recount(&mut self, c: u32, by: i32) {
        let old = self.clients[c as usize].count;
        if old > 0 {
            self.unlink(Chain::Bucket, c);
        }
        let new = old.saturating_add_signed(by);
        self.clients[c as usize].count = new;
        if new > 0 {
            if self.buckets.len() <= new as usize {
                self.buckets.resize(new as usize + 1, NIL);
            }
            let head = self.buckets[new as usize];
            self.clients[c as usize].bucket = Link { prev: NIL, next: head };
            if head != NIL {
                self.clients[head as usize].bucket.prev = c;
            }
            self.buckets[new as usize] = c;
        }
        if new > self.top {
            self.top = new;
        }
        while self.top > 0 && self.buckets[self.top as usize] == NIL {
            self.top -= 1;
        }
    }

    fn link_of(&mut self, chain: Chain, c: u32) -> &mut Link {
        let client = &mut self.clients[c as usize];
        match chain {
            Chain::Turns => &mut client.turns,
            Chain::Bucket => &mut client.bucket,
        }
    }

    fn unlink(&mut self, chain: Chain, c: u32) {
        let Link { prev, next } = *self.link_of(chain, c);
        *self.link_of(chain, c) = UNLINKED;
        match (chain, prev) {
            (Chain::Turns, NIL) => self.turns_head = next,
            (Chain::Bucket, NIL) => {
                let count = self.clients[c as usize].count as usize;
                self.buckets[count] = next;
            }
            (_, p) => self.link_of(chain, p).next = next,
        }
        match (chain, next) {
            (Chain::Turns, NIL) => self.turns_tail = prev,
            (Chain::Bucket, NIL) => {}
            (_, n) => self.link_of(chain, n).prev = prev,
        }
    }

    fn link_back(&mut self, c: u32) {
        let tail = self.turns_tail;
        self.clients[c as usize].turns = Link { prev: tail, next: NIL };
        match tail {
            NIL => self.turns_head = c,
            t => self.clients[t as usize].turns.next = c,
        }
        self.turns_tail = c;
    }

    fn link_front(&mut self, c: u32) {
        let head = self.turns_head;
        self.clients[c as usize].turns = Link { prev: NIL, next: head };
        match head {
            NIL => self.turns_tail = c,
            h => self.clients[h as usize].turns.prev = c,
        }
        self.turns_head = c;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;

    /// Pops everything, as (client, item).
    fn drain(line: &mut Line<char, (char, u32)>) -> Vec<(char, u32)> {
        std::iter::from_fn(|| line.pop()).collect()
    }

    #[test]
    fn clients_take_turns_and_each_keeps_its_order() {
        let mut line = Line::default();
        for i in 0..4 {
            line.push_back('a', ('a', i), 100).unwrap();
        }
        line.push_back('b', ('b', 0), 100).unwrap();
        line.push_back('c', ('c', 0), 100).unwrap();
        line.push_back('b', ('b', 1), 100).unwrap();
        assert_eq!((line.len(), line.clients(), line.count_of(&'a')), (7, 3, 4));
        assert_eq!(
            drain(&mut line),
            [('a', 0), ('b', 0), ('c', 0), ('a', 1), ('b', 1), ('a', 2), ('a', 3)],
            "one turn each per round, in the order the clients came"
        );
        assert_eq!(line.len(), 0);
        assert_eq!((line.clients(), line.top), (0, 0));
    }

    #[test]
    fn with_one_client_it_is_first_come_first_served() {
        let mut line = Line::default();
        let first = line.push_back('a', ('a', 0), 3).unwrap();
        assert!(first.first && first.displaced.is_none());
        for i in 1..3 {
            assert!(!line.push_back('a', ('a', i), 3).unwrap().first);
        }
        assert_eq!(line.push_back('a', ('a', 3), 3), Err(('a', 3)), "full, and nobody to displace");
        assert_eq!(drain(&mut line), [('a', 0), ('a', 1), ('a', 2)]);
    }

    #[test]
    fn a_full_line_gives_the_greediest_clients_newest_place_to_a_smaller_client() {
        let mut line = Line::default();
        for i in 0..3 {
            line.push_back('a', ('a', i), 4).unwrap();
        }
        line.push_back('b', ('b', 0), 4).unwrap();
        // b holds 1, a holds 3: b's second request takes a's newest place.
        let joined = line.push_back('b', ('b', 1), 4).unwrap();
        assert_eq!(joined.displaced, Some(('a', 2)));
        assert_eq!((line.count_of(&'a'), line.count_of(&'b')), (2, 2));
        // Now equal: neither takes the other's place.
        assert_eq!(line.push_back('b', ('b', 2), 4), Err(('b', 2)));
        assert_eq!(line.push_back('a', ('a', 3), 4), Err(('a', 3)));
        // A third client holding none may take a place of one holding two.
        let joined = line.push_back('c', ('c', 0), 4).unwrap();
        assert!(matches!(joined.displaced, Some(('a', 1) | ('b', 1))), "{joined:?}");
        // c holding one against two: taking a place would only swap which
        // client holds two.
        assert_eq!(line.len(), 4);
        assert_eq!(line.push_back('c', ('c', 1), 4), Err(('c', 1)));
        assert_eq!(line.push_back('d', ('d', 0), 0), Err(('d', 0)), "max 0: never queued");
    }

    #[test]
    fn a_requeued_place_keeps_its_turn_and_its_order() {
        let mut line = Line::default();
        let a0 = line.push_back('a', ('a', 0), 10).unwrap();
        let a1 = line.push_back('a', ('a', 1), 10).unwrap();
        let b0 = line.push_back('b', ('b', 0), 10).unwrap();
        // All three are woken.
        assert_eq!(line.pop(), Some(('a', 0)));
        assert_eq!(line.pop(), Some(('b', 0)));
        assert_eq!(line.pop(), Some(('a', 1)));
        // Found no room: back in line, each as the next in turn, a's two
        // in their order of arrival whatever order they come back in.
        line.requeue('a', ('a', 1), a1.seq).unwrap();
        line.requeue('b', ('b', 0), b0.seq).unwrap();
        line.requeue('a', ('a', 0), a0.seq).unwrap();
        assert_eq!(drain(&mut line), [('a', 0), ('b', 0), ('a', 1)]);
    }

    #[test]
    fn a_removed_place_is_gone_and_its_handle_goes_stale() {
        let mut line = Line::default();
        let a0 = line.push_back('a', ('a', 0), 10).unwrap();
        let a1 = line.push_back('a', ('a', 1), 10).unwrap();
        assert_eq!(line.front(), Some(a0.handle));
        assert_eq!(line.remove(a1.handle), Some((('a', 1), false)));
        assert_eq!(line.remove(a1.handle), None);
        // The freed slot is reused with another generation.
        let a2 = line.push_back('a', ('a', 2), 10).unwrap();
        assert_eq!(line.remove(a1.handle), None);
        assert_eq!(line.remove(a0.handle), Some((('a', 0), true)));
        assert_eq!(line.front(), Some(a2.handle));
        assert_eq!(Handle::from_bits(a2.handle.to_bits()), Some(a2.handle));
        assert_eq!(Handle::from_bits(Handle::NONE_BITS), None);
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// A newcomer of client `0` with the line's bound `1`.
        Push(u8, usize),
        /// Wake the next one; `true`: it finds no room and is requeued at
        /// the next `Requeue`.
        Pop(bool),
        /// The `n`th (modulo) of those popped to be requeued goes back.
        Requeue(usize),
        /// The `n`th (modulo) of those in line leaves.
        Remove(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..5, 1usize..12).prop_map(|(c, m)| Op::Push(c, m)),
            3 => any::<bool>().prop_map(Op::Pop),
            1 => any::<usize>().prop_map(Op::Requeue),
            1 => any::<usize>().prop_map(Op::Remove),
        ]
    }

    /// What the test knows of a waiter in line.
    #[derive(Debug, Clone, Copy)]
    struct Queued {
        client: u8,
        seq: u64,
        handle: Handle,
    }

    proptest! {
        /// Against any sequence of arrivals, wake-ups, requeues and
        /// departures: no waiter is lost or woken twice, each client's
        /// waiters are woken in their order, displacement takes only the
        /// newest place of a client holding the most from a client holding
        /// two fewer, and every client waiting gets a turn within one round.
        #[test]
        fn no_waiter_is_lost_or_woken_twice_and_every_client_gets_turns(ops in prop::collection::vec(op(), 1..200)) {
            let mut line: Line<u8, u32> = Line::default();
            let mut in_line: BTreeMap<u32, Queued> = BTreeMap::new();
            // Popped and found no room: (id, client, seq).
            let mut to_requeue: Vec<(u32, u8, u64)> = Vec::new();
            let mut next_id = 0u32;
            let count = |in_line: &BTreeMap<u32, Queued>, c: u8| in_line.values().filter(|q| q.client == c).count();
            for op in ops {
                match op {
                    Op::Push(c, max) => {
                        let id = next_id;
                        next_id += 1;
                        let mine = count(&in_line, c);
                        let top = (0..5).map(|k| count(&in_line, k)).max().unwrap_or(0);
                        match line.push_back(c, id, max) {
                            Err(back) => {
                                prop_assert_eq!(back, id);
                                prop_assert!(in_line.len() >= max && mine + 2 > top, "refused with room");
                            }
                            Ok(joined) => {
                                if let Some(out) = joined.displaced {
                                    prop_assert!(in_line.len() >= max, "displaced with room");
                                    let q = in_line.remove(&out).expect("the displaced one was in line");
                                    prop_assert_eq!(count(&in_line, q.client) + 1, top, "not the greediest");
                                    prop_assert!(mine + 2 <= top, "displaced for a client as greedy");
                                    let newest = in_line.values().filter(|o| o.client == q.client).all(|o| o.seq < q.seq);
                                    prop_assert!(newest, "not the client's newest");
                                } else {
                                    prop_assert!(in_line.len() < max);
                                }
                                prop_assert_eq!(joined.first, in_line.is_empty(), "first only in an empty line");
                                in_line.insert(id, Queued { client: c, seq: joined.seq, handle: joined.handle });
                            }
                        }
                    }
                    Op::Pop(requeue) => {
                        let front = line.front();
                        match line.pop() {
                            None => prop_assert!(in_line.is_empty()),
                            Some(id) => {
                                let q = in_line.remove(&id).expect("woken once, from the line");
                                prop_assert_eq!(Some(q.handle), front, "front() named another");
                                let oldest = in_line.values().filter(|o| o.client == q.client).all(|o| o.seq > q.seq);
                                prop_assert!(oldest, "a client's later waiter went first");
                                if requeue {
                                    to_requeue.push((id, q.client, q.seq));
                                }
                            }
                        }
                    }
                    Op::Requeue(n) if !to_requeue.is_empty() => {
                        let (id, c, seq) = to_requeue.swap_remove(n % to_requeue.len());
                        let handle = line.requeue(c, id, seq).expect("room for indices");
                        prop_assert_eq!(line.front().map(|h| line.nodes[h.index as usize].client), Some(line.by_key[&c]));
                        in_line.insert(id, Queued { client: c, seq, handle });
                    }
                    Op::Remove(n) if !in_line.is_empty() => {
                        let id = *in_line.keys().nth(n % in_line.len()).expect("in range");
                        let q = in_line.remove(&id).expect("there");
                        let front = line.front();
                        let (got, first) = line.remove(q.handle).expect("in line");
                        prop_assert_eq!(got, id);
                        prop_assert_eq!(first, front == Some(q.handle));
                        prop_assert_eq!(line.remove(q.handle), None, "removed twice");
                    }
                    Op::Requeue(_) | Op::Remove(_) => {}
                }
                prop_assert_eq!(line.len(), in_line.len());
                let clients: BTreeSet<u8> = in_line.values().map(|q| q.client).collect();
                prop_assert_eq!(line.clients(), clients.len());
                for c in 0..5 {
                    prop_assert_eq!(line.count_of(&c), count(&in_line, c));
                }
                let top = (0..5).map(|k| count(&in_line, k)).max().unwrap_or(0);
                prop_assert_eq!(line.top as usize, top);
            }
            // Every client waiting is woken within one round.
            let waiting: BTreeSet<u8> = in_line.values().map(|q| q.client).collect();
            let round: BTreeSet<u8> =
                (0..waiting.len()).filter_map(|_| line.pop()).map(|id| in_line[&id].client).collect();
            prop_assert_eq!(round, waiting);
        }
    }
}
