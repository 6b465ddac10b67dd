// Command eppcheck drives an endpoint picker (EPP) the way a Gateway API
// Inference Extension gateway does, next to the extension project's own
// reference picker (lwepp, pkg/lwepp/handlers at the pinned release) run in
// this process on the same endpoints, and compares the two.
//
// Every scenario is one ext_proc stream built with the Envoy API types of
// go-control-plane (the gateway side's encoder, not dscache's Python one).
// For each scenario it records the answers of both pickers and checks:
//
//   - the protocol the gateway relies on, for both pickers: the pick in the
//     x-gateway-destination-endpoint header and the same value in the envoy.lb
//     metadata, the route cache cleared, the pick one of the pool's endpoints
//     (and of the subset hint where one is given), the request and response
//     bodies handed back whole, in order, in chunks the extension's own
//     BuildChunkedBodyResponses would cut, the last one ending the stream;
//   - that the target answers with the reference's sequence of message kinds
//     (a gateway tears a stream down on an answer out of order);
//   - dscache's own promises: a conversation's turns with a session id stay on
//     one endpoint, and a subset naming no pool member is refused with 503.
//
// With --forward it is also the gateway's data path (the stand-in for Envoy
// where no gateway can run): each conversation turn goes to the endpoint picked
// (http://ENDPOINT/v1/chat/completions), the answer back through the picker
// with the served endpoint reported, and every later turn must find its
// conversation's KV on that pod (the usage's cached_tokens).
//
// It prints one JSON report and exits 0 when every check holds, 1 when one
// fails, 2 on a usage or connection error.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	pb "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
	"k8s.io/apimachinery/pkg/types"

	"sigs.k8s.io/gateway-api-inference-extension/pkg/common/envoy"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/lwepp/datastore"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/lwepp/handlers"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/lwepp/metadata"
)

// staticPool is the reference picker's datastore: the endpoints given on the
// command line, as the InferencePool's pods would be.
type staticPool struct{ endpoints []*datastore.Endpoint }

func (p *staticPool) PoolGet() (*datastore.EndpointPool, error) {
	return &datastore.EndpointPool{Namespace: "default"}, nil
}

func (p *staticPool) PodList(pred func(*datastore.Endpoint) bool) []*datastore.Endpoint {
	var out []*datastore.Endpoint
	for _, e := range p.endpoints {
		if pred(e) {
			out = append(out, e)
		}
	}
	return out
}

// Answer is one message a picker sent back, reduced to what a gateway acts on.
type Answer struct {
	Kind        string `json:"kind"`
	Destination string `json:"destination,omitempty"`
	Metadata    string `json:"metadata,omitempty"`
	ClearRoute  bool   `json:"clear_route_cache,omitempty"`
	BodyBytes   int    `json:"body_bytes,omitempty"`
	EndOfStream bool   `json:"end_of_stream,omitempty"`
	Status      int    `json:"status,omitempty"`
	body        []byte
}

// Transcript is one stream's answers and how the stream ended.
type Transcript struct {
	Answers []Answer `json:"answers"`
	Error   string   `json:"error,omitempty"`
}

// Pick is the first endpoint named by the stream's request-headers answer.
func (t Transcript) Pick() string {
	for _, a := range t.Answers {
		if a.Kind == "request_headers" && a.Destination != "" {
			return strings.TrimSpace(strings.Split(a.Destination, ",")[0])
		}
	}
	return ""
}

// Kinds is the sequence of message kinds, runs of body chunks as one.
func (t Transcript) Kinds() []string {
	var out []string
	for _, a := range t.Answers {
		if len(out) > 0 && out[len(out)-1] == a.Kind && strings.HasSuffix(a.Kind, "_body") {
			continue
		}
		out = append(out, a.Kind)
	}
	if t.Error != "" {
		out = append(out, "error")
	}
	return out
}

// Body is what the answers of one body kind hand back, joined.
func (t Transcript) Body(kind string) []byte {
	var out []byte
	for _, a := range t.Answers {
		if a.Kind == kind {
			out = append(out, a.body...)
		}
	}
	return out
}

// Scenario is one stream a gateway could send.
type Scenario struct {
	Name     string
	Messages []*pb.ProcessingRequest
	// Sent bodies, to compare with what comes back.
	RequestBody  []byte
	ResponseBody []byte
	Subset       []string
}

// Check is one verdict of the report.
type Check struct {
	Name   string `json:"name"`
	OK     bool   `json:"ok"`
	Detail string `json:"detail,omitempty"`
}

// Report is what eppcheck prints.
type Report struct {
	Target      string                `json:"target"`
	Reference   string                `json:"reference"`
	Endpoints   []string              `json:"endpoints"`
	Transcripts map[string]Transcript `json:"transcripts"`
	// Conversations: each conversation's picks, turn by turn.
	Conversations map[string][]string `json:"conversations"`
	// Turns: with --forward, what each conversation's endpoints answered.
	Turns  map[string][]Turn `json:"turns,omitempty"`
	Checks []Check           `json:"checks"`
	OK     bool              `json:"ok"`
}

func headerMap(kv ...string) *corev3.HeaderMap {
	m := &corev3.HeaderMap{}
	for i := 0; i+1 < len(kv); i += 2 {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return m
}

func requestHeaders(end, duplex bool, subset []string, kv ...string) *pb.ProcessingRequest {
	req := &pb.ProcessingRequest{
		Request: &pb.ProcessingRequest_RequestHeaders{
			RequestHeaders: &pb.HttpHeaders{Headers: headerMap(kv...), EndOfStream: end},
		},
	}
	if duplex {
		req.ProtocolConfig = &pb.ProtocolConfiguration{
			RequestBodyMode:  extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED,
			ResponseBodyMode: extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		}
	}
	if subset != nil {
		values := make([]any, len(subset))
		for i, s := range subset {
			values[i] = s
		}
		hint, err := structpb.NewStruct(map[string]any{metadata.SubsetFilterKey: values})
		if err != nil {
			panic(err)
		}
		req.MetadataContext = &corev3.Metadata{
			FilterMetadata: map[string]*structpb.Struct{metadata.SubsetFilterNamespace: hint},
		}
	}
	return req
}

// bodyChunks cuts a body as Envoy streams it: chunks of `size` bytes.
func bodyChunks(body []byte, size int, response bool) []*pb.ProcessingRequest {
	var out []*pb.ProcessingRequest
	for start := 0; start < len(body) || len(out) == 0; start += size {
		end := min(start+size, len(body))
		chunk := &pb.HttpBody{Body: body[start:end], EndOfStream: end == len(body)}
		if response {
			out = append(out, &pb.ProcessingRequest{Request: &pb.ProcessingRequest_ResponseBody{ResponseBody: chunk}})
		} else {
			out = append(out, &pb.ProcessingRequest{Request: &pb.ProcessingRequest_RequestBody{RequestBody: chunk}})
		}
	}
	return out
}

func responseHeaders(served string) *pb.ProcessingRequest {
	lb, err := structpb.NewStruct(map[string]any{metadata.DestinationEndpointServedKey: served})
	if err != nil {
		panic(err)
	}
	return &pb.ProcessingRequest{
		Request: &pb.ProcessingRequest_ResponseHeaders{
			ResponseHeaders: &pb.HttpHeaders{Headers: headerMap(":status", "200", "content-type", "application/json")},
		},
		MetadataContext: &corev3.Metadata{
			FilterMetadata: map[string]*structpb.Struct{metadata.DestinationEndpointNamespace: lb},
		},
	}
}

// chatBody is turn `turns` of a conversation: an OpenAI chat request whose history
// grows by one exchange a turn.
func chatBody(topic string, turns int, pad int) []byte {
	type message struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	msgs := []message{{Role: "system", Content: "You are a careful analyst of " + topic + "."}}
	// Turn n resends turns 1..n-1 with their answers, as a chat client does.
	for i := 0; i < turns; i++ {
		msgs = append(msgs, message{Role: "user", Content: fmt.Sprintf("Question %d about the filing: %s", i, strings.Repeat("revenue margin guidance ", pad))})
		if i < turns-1 {
			msgs = append(msgs, message{Role: "assistant", Content: fmt.Sprintf("Answer %d: the figures say so.", i)})
		}
	}
	// No "model": a server that serves one model takes the request as its own.
	out, err := json.Marshal(map[string]any{"messages": msgs, "max_tokens": 2, "temperature": 0})
	if err != nil {
		panic(err)
	}
	return out
}

func scenarios(endpoints []string) []Scenario {
	post := []string{":method", "POST", ":path", "/v1/chat/completions", "content-type", "application/json"}
	small := chatBody("quarterly filings", 1, 4)
	large := chatBody("annual reports", 3, 2600)                                        // about 150 KB: several of Envoy's chunks and of the extension's
	reply := []byte(strings.Repeat(`{"choices":[{"message":{"content":"ok"}}]}`, 2500)) // about 105 KB
	var out []Scenario

	add := func(s Scenario) { out = append(out, s) }
	add(Scenario{
		Name:        "duplex_one_chunk",
		Messages:    append([]*pb.ProcessingRequest{requestHeaders(false, true, nil, post...)}, bodyChunks(small, 1<<20, false)...),
		RequestBody: small,
	})
	add(Scenario{
		Name:        "duplex_chunked_body",
		Messages:    append([]*pb.ProcessingRequest{requestHeaders(false, true, nil, post...)}, bodyChunks(large, 16384, false)...),
		RequestBody: large,
	})
	add(Scenario{
		Name:        "no_protocol_config",
		Messages:    append([]*pb.ProcessingRequest{requestHeaders(false, false, nil, post...)}, bodyChunks(small, 1<<20, false)...),
		RequestBody: small,
	})
	add(Scenario{
		Name:     "headers_only",
		Messages: []*pb.ProcessingRequest{requestHeaders(true, true, nil, ":method", "GET", ":path", "/v1/models")},
	})
	full := append([]*pb.ProcessingRequest{requestHeaders(false, true, nil, post...)}, bodyChunks(small, 1<<20, false)...)
	full = append(full, responseHeaders(endpoints[0]))
	full = append(full, bodyChunks(reply, 40000, true)...)
	add(Scenario{Name: "request_and_response", Messages: full, RequestBody: small, ResponseBody: reply})
	subset := []string{endpoints[len(endpoints)-1]}
	add(Scenario{
		Name:        "subset_hint",
		Messages:    append([]*pb.ProcessingRequest{requestHeaders(false, true, subset, post...)}, bodyChunks(small, 1<<20, false)...),
		RequestBody: small,
		Subset:      subset,
	})
	return out
}

// run sends one scenario on its own stream and records the answers.
func run(ctx context.Context, conn *grpc.ClientConn, s Scenario) Transcript {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	var t Transcript
	stream, err := pb.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		t.Error = err.Error()
		return t
	}
	// Like a gateway in duplex mode, send every message without waiting for answers.
	go func() {
		for _, m := range s.Messages {
			if stream.Send(m) != nil {
				return
			}
		}
		_ = stream.CloseSend()
	}()
	for {
		resp, err := stream.Recv()
		if err == io.EOF {
			return t
		}
		if err != nil {
			t.Error = status.Code(err).String() + ": " + status.Convert(err).Message()
			return t
		}
		t.Answers = append(t.Answers, answerOf(resp))
	}
}

func answerOf(resp *pb.ProcessingResponse) Answer {
	var a Answer
	var common *pb.CommonResponse
	switch r := resp.Response.(type) {
	case *pb.ProcessingResponse_RequestHeaders:
		a.Kind, common = "request_headers", r.RequestHeaders.GetResponse()
	case *pb.ProcessingResponse_RequestBody:
		a.Kind, common = "request_body", r.RequestBody.GetResponse()
	case *pb.ProcessingResponse_ResponseHeaders:
		a.Kind, common = "response_headers", r.ResponseHeaders.GetResponse()
	case *pb.ProcessingResponse_ResponseBody:
		a.Kind, common = "response_body", r.ResponseBody.GetResponse()
	case *pb.ProcessingResponse_ImmediateResponse:
		a.Kind = "immediate"
		a.Status = int(r.ImmediateResponse.GetStatus().GetCode())
	default:
		a.Kind = fmt.Sprintf("other:%T", r)
	}
	if common != nil {
		a.ClearRoute = common.GetClearRouteCache()
		for _, h := range common.GetHeaderMutation().GetSetHeaders() {
			if strings.EqualFold(h.GetHeader().GetKey(), metadata.DestinationEndpointKey) {
				a.Destination = envoy.GetHeaderValue(h.GetHeader())
			}
		}
		if streamed := common.GetBodyMutation().GetStreamedResponse(); streamed != nil {
			a.body = streamed.GetBody()
			a.BodyBytes = len(a.body)
			a.EndOfStream = streamed.GetEndOfStream()
		}
	}
	if lb, ok := resp.GetDynamicMetadata().GetFields()[metadata.DestinationEndpointNamespace]; ok {
		a.Metadata = lb.GetStructValue().GetFields()[metadata.DestinationEndpointKey].GetStringValue()
	}
	return a
}

// Turn is one conversation turn sent as a gateway sends it (--forward).
type Turn struct {
	Pick         string `json:"pick"`
	Status       int    `json:"status"`
	PromptTokens int    `json:"prompt_tokens"`
	CachedTokens int    `json:"cached_tokens"`
	Error        string `json:"error,omitempty"`
}

// converse sends one request as a gateway does: the request through the picker,
// then to the endpoint it named (plain HTTP, the endpoint's /v1/chat/completions),
// then the endpoint's answer back through the picker with the served endpoint
// reported in the envoy.lb metadata, on one ext_proc stream.
func converse(ctx context.Context, conn *grpc.ClientConn, headers []string, body []byte) Turn {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	var turn Turn
	fail := func(format string, args ...any) Turn {
		turn.Error = fmt.Sprintf(format, args...)
		return turn
	}
	stream, err := pb.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		return fail("open stream: %v", err)
	}
	for _, m := range append([]*pb.ProcessingRequest{requestHeaders(false, true, nil, headers...)}, bodyChunks(body, 1<<20, false)...) {
		if err := stream.Send(m); err != nil {
			return fail("send request: %v", err)
		}
	}
	forwarded := []byte{}
	for done := false; !done; {
		resp, err := stream.Recv()
		if err != nil {
			return fail("the request's answers: %v", err)
		}
		a := answerOf(resp)
		switch a.Kind {
		case "request_headers":
			turn.Pick = strings.TrimSpace(strings.Split(a.Destination, ",")[0])
		case "request_body":
			forwarded = append(forwarded, a.body...)
			done = a.EndOfStream
		default:
			return fail("answer %q before the request body was handed back", a.Kind)
		}
	}
	if turn.Pick == "" {
		return fail("no endpoint picked")
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+turn.Pick+"/v1/chat/completions", bytes.NewReader(forwarded))
	if err != nil {
		return fail("request: %v", err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(headers); i += 2 {
		if !strings.HasPrefix(headers[i], ":") {
			req.Header.Set(headers[i], headers[i+1])
		}
	}
	httpResp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fail("forward to %s: %v", turn.Pick, err)
	}
	reply, err := io.ReadAll(httpResp.Body)
	httpResp.Body.Close()
	if err != nil {
		return fail("read %s's answer: %v", turn.Pick, err)
	}
	turn.Status = httpResp.StatusCode
	var usage struct {
		Usage struct {
			PromptTokens int `json:"prompt_tokens"`
			Details      struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if json.Unmarshal(reply, &usage) == nil {
		turn.PromptTokens = usage.Usage.PromptTokens
		turn.CachedTokens = usage.Usage.Details.CachedTokens
	}
	for _, m := range append([]*pb.ProcessingRequest{responseHeaders(turn.Pick)}, bodyChunks(reply, 1<<20, true)...) {
		if err := stream.Send(m); err != nil {
			return fail("send response: %v", err)
		}
	}
	if err := stream.CloseSend(); err != nil {
		return fail("close: %v", err)
	}
	for {
		resp, err := stream.Recv()
		if err == io.EOF {
			return turn
		}
		if err != nil {
			return fail("the response's answers: %v", err)
		}
		if a := answerOf(resp); a.Kind != "response_headers" && a.Kind != "response_body" {
			return fail("answer %q to the response", a.Kind)
		}
	}
}

// protocol checks what a gateway relies on in one transcript.
func protocol(who string, s Scenario, t Transcript, endpoints []string) []Check {
	name := func(what string) string { return who + "/" + s.Name + "/" + what }
	var checks []Check
	add := func(what string, ok bool, format string, args ...any) {
		c := Check{Name: name(what), OK: ok}
		if !ok {
			c.Detail = fmt.Sprintf(format, args...)
		}
		checks = append(checks, c)
	}
	add("stream_ok", t.Error == "", "stream ended with %s", t.Error)
	var headers *Answer
	for i := range t.Answers {
		if t.Answers[i].Kind == "request_headers" {
			headers = &t.Answers[i]
			break
		}
	}
	add("picks", headers != nil && headers.Destination != "", "no request-headers answer naming an endpoint: %v", t.Kinds())
	if headers == nil || headers.Destination == "" {
		return checks
	}
	add("metadata_matches_header", headers.Metadata == headers.Destination,
		"header %q, envoy.lb metadata %q", headers.Destination, headers.Metadata)
	add("clears_route_cache", headers.ClearRoute, "clear_route_cache not set")
	named := strings.Split(headers.Destination, ",")
	inPool := true
	for _, n := range named {
		inPool = inPool && slices.Contains(endpoints, strings.TrimSpace(n))
	}
	add("endpoints_in_pool", inPool, "%q names an endpoint outside %v", headers.Destination, endpoints)
	if s.Subset != nil {
		add("pick_in_subset", slices.Contains(s.Subset, t.Pick()), "picked %q, subset %v", t.Pick(), s.Subset)
	}
	add("headers_answered_first", t.Answers[0].Kind == "request_headers",
		"first answer %q (a body answer before the headers' is out of order)", t.Answers[0].Kind)
	for _, phase := range []struct {
		kind string
		sent []byte
	}{{"request_body", s.RequestBody}, {"response_body", s.ResponseBody}} {
		if phase.sent == nil {
			continue
		}
		got := t.Body(phase.kind)
		add(phase.kind+"_whole", string(got) == string(phase.sent), "sent %d bytes, %d came back", len(phase.sent), len(got))
		var last *Answer
		fits := true
		for i := range t.Answers {
			if t.Answers[i].Kind == phase.kind {
				last = &t.Answers[i]
				fits = fits && t.Answers[i].BodyBytes <= envoy.BodyByteLimit
			}
		}
		add(phase.kind+"_chunks_fit", fits, "a chunk over the extension's %d-byte limit", envoy.BodyByteLimit)
		add(phase.kind+"_ends_stream", last != nil && last.EndOfStream, "the last %s answer does not end the stream", phase.kind)
	}
	return checks
}

func mustConn(addr string) *grpc.ClientConn {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintf(os.Stderr, "eppcheck: %s: %v\n", addr, err)
		os.Exit(2)
	}
	return conn
}

func main() {
	target := flag.String("target", "", "the endpoint picker to check, HOST:PORT (ext_proc over plaintext gRPC)")
	pool := flag.String("endpoints", "", "the pool's endpoints, IP:PORT,IP:PORT,... (as the target was given them)")
	session := flag.String("session-header", "x-session-id", "the header carrying a session id")
	conversations := flag.Int("conversations", 6, "conversations of three turns, with a session id and again without")
	forward := flag.Bool("forward", false, "act as the gateway's data path too: send each conversation turn to the endpoint picked "+
		"(http://ENDPOINT/v1/chat/completions) and its answer back through the picker; later turns must hit the pod's cache")
	think := flag.Duration("think", time.Second, "pause between rounds of conversation turns")
	pad := flag.Int("pad", 40, "words of each conversation turn, in threes (a turn must fill a KV block for --forward's cache check)")
	flag.Parse()
	endpoints := strings.Split(*pool, ",")
	if *target == "" || *pool == "" || len(endpoints) < 2 {
		fmt.Fprintln(os.Stderr, "usage: eppcheck --target HOST:PORT --endpoints IP:PORT,IP:PORT[,...]")
		os.Exit(2)
	}
	ds := &staticPool{}
	for i, e := range endpoints {
		host, port, err := net.SplitHostPort(e)
		if err != nil {
			fmt.Fprintf(os.Stderr, "eppcheck: endpoint %q: %v\n", e, err)
			os.Exit(2)
		}
		ds.endpoints = append(ds.endpoints, &datastore.Endpoint{
			NamespacedName: types.NamespacedName{Namespace: "default", Name: fmt.Sprintf("pod-%d", i)},
			PodName:        fmt.Sprintf("pod-%d", i), Address: host, Port: port,
		})
	}

	// The reference picker, served in this process on a loopback port.
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintf(os.Stderr, "eppcheck: listen: %v\n", err)
		os.Exit(2)
	}
	ref := grpc.NewServer()
	pb.RegisterExternalProcessorServer(ref, handlers.NewStreamingServer(ds))
	go func() { _ = ref.Serve(lis) }()
	defer ref.Stop()

	report := Report{Target: *target, Reference: "lwepp (gateway-api-inference-extension v1.6.2)", Endpoints: endpoints,
		Transcripts: map[string]Transcript{}, Conversations: map[string][]string{}, Turns: map[string][]Turn{}}
	targetConn, refConn := mustConn(*target), mustConn(lis.Addr().String())
	defer targetConn.Close()
	defer refConn.Close()
	ctx := context.Background()

	for _, s := range scenarios(endpoints) {
		mine, theirs := run(ctx, targetConn, s), run(ctx, refConn, s)
		report.Transcripts["target/"+s.Name] = mine
		report.Transcripts["reference/"+s.Name] = theirs
		report.Checks = append(report.Checks, protocol("reference", s, theirs, endpoints)...)
		report.Checks = append(report.Checks, protocol("target", s, mine, endpoints)...)
		same := slices.Equal(mine.Kinds(), theirs.Kinds())
		c := Check{Name: "target/" + s.Name + "/same_message_order_as_reference", OK: same}
		if !same {
			c.Detail = fmt.Sprintf("target %v, reference %v", mine.Kinds(), theirs.Kinds())
		}
		report.Checks = append(report.Checks, c)
	}

	// dscache's own promises, past what the reference picker (round robin) does:
	// every turn of a conversation goes where its earlier turns went, with its
	// session id and without one (then the prompt's opening carries it). The
	// conversations take turns, as a gateway's clients do: a round of first
	// turns, then of second turns, so a pod has stored a turn before the next.
	type conversation struct {
		name    string
		headers []string
		picks   []string
	}
	var convs []*conversation
	for _, withSession := range []bool{true, false} {
		for i := 0; i < *conversations; i++ {
			c := &conversation{name: fmt.Sprintf("nosession_%d", i), headers: []string{":method", "POST", ":path", "/v1/chat/completions"}}
			if withSession {
				c.name = fmt.Sprintf("session_%d", i)
				c.headers = append(c.headers, *session, fmt.Sprintf("eppcheck-%d", i))
			}
			convs = append(convs, c)
		}
	}
	for turn := 1; turn <= 3; turn++ {
		if turn > 1 {
			time.Sleep(*think)
		}
		for _, c := range convs {
			body := chatBody(c.name+" filing", turn, *pad)
			if *forward {
				t := converse(ctx, targetConn, c.headers, body)
				report.Turns[c.name] = append(report.Turns[c.name], t)
				c.picks = append(c.picks, t.Pick)
				continue
			}
			s := Scenario{Name: fmt.Sprintf("%s_turn_%d", c.name, turn),
				Messages: append([]*pb.ProcessingRequest{requestHeaders(false, true, nil, c.headers...)}, bodyChunks(body, 1<<20, false)...)}
			t := run(ctx, targetConn, s)
			report.Transcripts["target/"+s.Name] = t
			c.picks = append(c.picks, t.Pick())
		}
	}
	for _, conv := range convs {
		picks := conv.picks
		report.Conversations[conv.name] = picks
		sticky := picks[0] != "" && picks[1] == picks[0] && picks[2] == picks[0]
		c := Check{Name: "target/" + conv.name + "/turns_stay_on_one_endpoint", OK: sticky}
		if !sticky {
			c.Detail = fmt.Sprintf("picks %v", picks)
		}
		report.Checks = append(report.Checks, c)
		if *forward {
			// Served where the picker said, and every later turn found the
			// earlier turns' KV on that pod.
			var problems []string
			for n, t := range report.Turns[conv.name] {
				if t.Error != "" || t.Status != http.StatusOK {
					problems = append(problems, fmt.Sprintf("turn %d: status %d %s", n+1, t.Status, t.Error))
				} else if n > 0 && t.CachedTokens == 0 {
					problems = append(problems, fmt.Sprintf("turn %d: no cached tokens of %d", n+1, t.PromptTokens))
				}
			}
			c := Check{Name: "target/" + conv.name + "/later_turns_hit_the_pods_cache", OK: len(problems) == 0}
			c.Detail = strings.Join(problems, "; ")
			report.Checks = append(report.Checks, c)
		}
	}

	outside := Scenario{Name: "subset_outside_pool",
		Messages: append([]*pb.ProcessingRequest{requestHeaders(false, true, []string{"192.0.2.1:1"}, ":method", "POST", ":path", "/v1/chat/completions")},
			bodyChunks(chatBody("quarterly filings", 1, 4), 1<<20, false)...)}
	t := run(ctx, targetConn, outside)
	report.Transcripts["target/"+outside.Name] = t
	refused := len(t.Answers) > 0 && t.Answers[len(t.Answers)-1].Kind == "immediate" && t.Answers[len(t.Answers)-1].Status == 503 && t.Pick() == ""
	c := Check{Name: "target/subset_outside_pool_is_503", OK: refused}
	if !refused {
		c.Detail = fmt.Sprintf("answers %v", t.Kinds())
	}
	report.Checks = append(report.Checks, c)

	report.OK = true
	for _, c := range report.Checks {
		report.OK = report.OK && c.OK
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	_ = enc.Encode(report)
	if !report.OK {
		os.Exit(1)
	}
}
